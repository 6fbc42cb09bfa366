//! Config and RPC fields of types that parse from a name (`FromStr` with a message
//! that says what is expected): `#[serde(with = "crate::serde_str")]`, or
//! `crate::serde_str::opt` for optional ones.

use std::str::FromStr;

use serde::{de::Error, Deserialize, Deserializer, Serializer};

/// Writes the value by its name (`Display`), as `deserialize` reads it.
pub fn serialize<T: std::fmt::Display, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

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
