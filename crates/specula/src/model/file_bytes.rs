//! The bytes of a model file: memory-mapped from disk, or held in memory (fuzzing and tests parse bytes that
//! never touch the disk).

use std::path::Path;

use crate::error::{Error, Result};

pub enum FileBytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl FileBytes {
    /// Maps `path` read-only.
    pub fn map(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only and specula never writes the file while it is mapped.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Ok(FileBytes::Mapped(mmap))
    }
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Owned(v) => v,
        }
    }
}
