//! Errors of the backends' control paths (opening, resizing, handing over). Each
//! module has its own [`thiserror`] type with the context an operator needs (the
//! path, the size, the range); where a trait of this crate returns
//! [`io::Error`], the typed error travels inside it ([`io::Error::new`] with the
//! kind it maps to) and [`typed`] finds it again. The I/O path never builds these:
//! it reports [`crate::IoStatus`].

use std::io;

/// A size or block size a disk cannot have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("block size {0} is not 512 or 4096")]
    BlockSize(u32),
    #[error("size {size} is not a non-zero multiple of the block size {block_size}")]
    Size { size: u64, block_size: u64 },
}

impl GeometryError {
    /// Checks a block size: 512 or 4096.
    pub fn check_block_size(block_size: u32) -> Result<(), GeometryError> {
        if block_size == 512 || block_size == 4096 {
            Ok(())
        } else {
            Err(GeometryError::BlockSize(block_size))
        }
    }

    /// Checks a size: a non-zero multiple of `block_size`.
    pub fn check_size(size: u64, block_size: u64) -> Result<(), GeometryError> {
        if size != 0 && block_size != 0 && size.is_multiple_of(block_size) {
            Ok(())
        } else {
            Err(GeometryError::Size { size, block_size })
        }
    }
}

impl From<GeometryError> for io::Error {
    fn from(e: GeometryError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidInput, e)
    }
}

/// The device cannot change its size at all (the default of
/// [`crate::BlockDevice::resize`]).
#[derive(Debug, thiserror::Error)]
#[error("{device} cannot change size")]
pub struct FixedSize {
    /// The device's description ([`crate::BlockDevice::describe`]).
    pub device: String,
}

impl From<FixedSize> for io::Error {
    fn from(e: FixedSize) -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, e)
    }
}

/// The typed error of this crate that `e` carries, if it carries one of type `E`
/// (see the module documentation): what tests and callers match instead of the
/// message.
pub fn typed<E: std::error::Error + 'static>(e: &io::Error) -> Option<&E> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<E>())
}
