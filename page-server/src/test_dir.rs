//! A test's own directory under the system's temporary directory, removed
//! when the test ends, whether it passed or panicked: a failing test must
//! not leave files behind in /tmp any more than a passing one.

use std::ops::Deref;
use std::path::{Path, PathBuf};

pub struct TestDir(PathBuf);

impl TestDir {
    /// `$TMPDIR/pageshare-<what>-<pid>`, new and empty.  The pid keeps
    /// concurrent test binaries apart, `what` the tests of one binary
    /// (which run in parallel threads).
    pub fn new(what: &str) -> TestDir {
        let d = std::env::temp_dir().join(format!("pageshare-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TestDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}
