//! Backend kinds, the word before the colon of a namespace spec (`ram:1G`,
//! `file:/path`). Each kind is one module here plus one line in [`KINDS`]: it parses
//! its argument and its own options, says what it stores data in (so namespaces on
//! the same file share one opened device and their slices are checked for
//! overlap), and opens its `bdev` device. Options every kind takes (block size,
//! slices, read-only, QoS, fault injection) are parsed once, in `nsspec`.

mod file;
mod kind;
mod memory;
mod qcow2;
#[cfg(feature = "rbd")]
pub mod rbd;

pub use kind::{dir_of, BackendKind, Backing, KindSpec, NoEnv, NsKind, OpenEnv};

/// Every backend kind `--ns`, `--disk`, TOML and the RPC accept.
pub static KINDS: &[&dyn BackendKind] = &[
    &memory::NULL,
    &memory::RAM,
    &file::File,
    &qcow2::Qcow2,
    #[cfg(feature = "rbd")]
    &rbd::Rbd,
];

/// The kind called `name`.
pub fn find(name: &str) -> Result<&'static dyn BackendKind, String> {
    KINDS
        .iter()
        .copied()
        .find(|k| k.name() == name)
        .ok_or_else(|| {
            let known: Vec<&str> = KINDS.iter().map(|k| k.name()).collect();
            format!("unknown kind `{name}` (known: {})", known.join(", "))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_found_by_its_name_and_has_a_valid_example() {
        for k in KINDS {
            assert_eq!(find(k.name()).unwrap().name(), k.name());
            let spec: crate::nsspec::NsSpec = k.example().parse().unwrap();
            assert!(spec.to_string().starts_with(k.name()), "{spec}");
        }
        let e = find("disk").err().unwrap();
        assert!(e.contains("known: null, ram, file"), "{e}");
    }
}
