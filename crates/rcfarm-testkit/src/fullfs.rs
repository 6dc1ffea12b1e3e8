//! A small file system of a test's own (a size-limited tmpfs), to fill up under a SQLite
//! database. Mounting needs root: `Err` says why not, for a loud skip.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct SmallFs {
    dir: tempfile::TempDir,
    filler: PathBuf,
}

impl SmallFs {
    /// A tmpfs of `size` (`"4m"`, say) mounted on a new temporary directory.
    pub fn mount(size: &str) -> Result<SmallFs, String> {
        let dir = tempfile::Builder::new()
            .prefix("rcfarm-smallfs-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "cannot mount a tmpfs (needs root): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let filler = dir.path().join("filler");
        Ok(SmallFs { dir, filler })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills every byte left with a file; returns how many it took.
    pub fn fill(&self) -> u64 {
        let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.filler)
        else {
            return 0;
        };
        let block = vec![0u8; 4096];
        let mut n = 0u64;
        while f.write_all(&block).is_ok() {
            n += block.len() as u64;
        }
        // The last partial block, byte by byte: a tmpfs page is all or nothing, but be sure.
        while f.write_all(&[0u8]).is_ok() {
            n += 1;
        }
        let _ = f.flush();
        n
    }

    /// Fills it but for `room` bytes.
    pub fn fill_but(&self, room: u64) -> u64 {
        let n = self.fill();
        let keep = n.saturating_sub(room);
        if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&self.filler) {
            let _ = f.set_len(keep);
        }
        keep
    }

    /// Frees what [`SmallFs::fill`] took.
    pub fn free(&self) {
        let _ = std::fs::remove_file(&self.filler);
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}
