//! Config and RPC fields of types that parse from a name (`FromStr` with a message
//! that says what is expected): `#[serde(with = "crate::serde_str")]`, or
//! `crate::serde_str::opt` for optional ones.

use std::str::FromStr;

use serde::{de::Error, Deserialize, Deserializer};

pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
where
    T: FromStr<Err = String>,
    D: Deserializer<'de>,
{
    String::deserialize(d)?.parse().map_err(D::Error::custom)
}

pub mod opt {
    use super::*;

    pub fn deserialize<'de, T, D>(d: D) -> Result<Option<T>, D::Error>
    where
        T: FromStr<Err = String>,
        D: Deserializer<'de>,
    {
        Option::<String>::deserialize(d)?
            .map(|s| s.parse().map_err(D::Error::custom))
            .transpose()
    }
}
