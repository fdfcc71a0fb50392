//! Data with checksums: data sets, big files and the [`Writer`] that keeps I/O going.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::harness::machine::drop_caches;

pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Files written with their SHA-256.
#[derive(Clone, Debug, Default)]
pub(crate) struct DataSet {
    pub(crate) files: Vec<(PathBuf, [u8; 32])>,
}

impl DataSet {
    /// Writes `count` files of `size` bytes under `dir`, each fsynced, and the directory.
    pub(crate) fn write(dir: &Path, prefix: &str, count: usize, size: usize) -> Self {
        let mut files = Vec::new();
        for i in 0..count {
            let path = dir.join(format!("{prefix}-{i}.bin"));
            let seed = Sha256::digest(path.to_string_lossy().as_bytes())[0..8]
                .iter()
                .fold(0u64, |a, b| (a << 8) | u64::from(*b));
            let data = pattern(seed, size);
            let mut f =
                File::create(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
            f.write_all(&data)
                .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            f.sync_all()
                .unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
            files.push((path, Sha256::digest(&data).into()));
        }
        File::open(dir)
            .and_then(|d| d.sync_all())
            .expect("fsync directory");
        println!(
            "  wrote {count} x {} KiB under {} (fsynced)",
            size / 1024,
            dir.display()
        );
        Self { files }
    }

    /// Reads every file (after dropping the page cache, so the data comes from the target) and
    /// compares checksums. `base` re-roots the paths (another mount of the same filesystem).
    pub(crate) fn verify_at(&self, from: &Path, base: &Path) {
        drop_caches();
        for (path, sum) in &self.files {
            let path = base.join(path.strip_prefix(from).expect("data under its root"));
            let data = fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let got: [u8; 32] = Sha256::digest(&data).into();
            assert_eq!(&got, sum, "checksum of {} differs", path.display());
        }
        println!(
            "  verified {} files (page cache dropped, SHA-256 equal)",
            self.files.len()
        );
    }

    pub(crate) fn verify(&self) {
        self.verify_at(Path::new("/"), Path::new("/"));
    }
}

/// Block `i` of a big file: one random MiB (made once) with the block number in front, so
/// every block differs. Big files are compared byte for byte (SHA-256 of tens of MiB in a debug
/// build under TCG would take minutes).
pub(crate) fn big_block(base: &[u8], i: usize) -> Vec<u8> {
    let mut b = base.to_vec();
    b[..8].copy_from_slice(&(i as u64).to_le_bytes());
    b
}

pub(crate) fn write_big_file(path: &Path, mib: usize) {
    let base = pattern(0xB16, 1024 * 1024);
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    for i in 0..mib {
        f.write_all(&big_block(&base, i))
            .unwrap_or_else(|e| panic!("write {} block {i}: {e}", path.display()));
    }
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
    println!("  wrote {mib} MiB to {} (fsynced)", path.display());
}

pub(crate) fn verify_big_file(path: &Path, mib: usize) {
    drop_caches();
    let base = pattern(0xB16, 1024 * 1024);
    let mut f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = vec![0u8; 1024 * 1024];
    for i in 0..mib {
        f.read_exact(&mut buf)
            .unwrap_or_else(|e| panic!("read {} block {i}: {e}", path.display()));
        assert!(
            buf == big_block(&base, i),
            "{} block {i} differs",
            path.display()
        );
    }
    println!(
        "  verified {mib} MiB of {} block by block (page cache dropped)",
        path.display()
    );
}

/// Appends checksummed chunks to one file with fsync after each, until stopped: I/O that goes on
/// while the storage side restarts.
pub(crate) struct Writer {
    stop: Arc<AtomicBool>,
    state: Arc<Mutex<WriterState>>,
    thread: Option<std::thread::JoinHandle<()>>,
    path: PathBuf,
}

#[derive(Debug, Default, Clone)]
pub(crate) struct WriterState {
    pub(crate) chunks: Vec<[u8; 32]>,
    pub(crate) errors: Vec<String>,
    pub(crate) max_latency: Duration,
    pub(crate) done: bool,
}

pub(crate) const CHUNK: usize = 128 * 1024;

impl Writer {
    pub(crate) fn start(path: &Path) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(Mutex::new(WriterState::default()));
        let (s, st, p) = (Arc::clone(&stop), Arc::clone(&state), path.to_owned());
        let thread = std::thread::spawn(move || {
            let mut f = match OpenOptions::new().create(true).append(true).open(&p) {
                Ok(f) => f,
                Err(e) => {
                    let mut g = st.lock().unwrap();
                    g.errors.push(format!("open: {e}"));
                    g.done = true;
                    return;
                }
            };
            let mut i = 0u64;
            while !s.load(Ordering::SeqCst) {
                let data = pattern(0x5EED_0000 + i, CHUNK);
                let t = Instant::now();
                let r = f.write_all(&data).and_then(|()| f.sync_data());
                let mut g = st.lock().unwrap();
                g.max_latency = g.max_latency.max(t.elapsed());
                match r {
                    Ok(()) => g.chunks.push(Sha256::digest(&data).into()),
                    Err(e) => {
                        g.errors.push(format!("chunk {i}: {e}"));
                        break;
                    }
                }
                drop(g);
                i += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            st.lock().unwrap().done = true;
        });
        println!("  writer started on {}", path.display());
        Self {
            stop,
            state,
            thread: Some(thread),
            path: path.to_owned(),
        }
    }

    pub(crate) fn snapshot(&self) -> WriterState {
        self.state.lock().unwrap().clone()
    }

    /// Stops the writer, waiting up to `timeout` for its last write to return.
    pub(crate) fn finish(&mut self, timeout: Duration) -> WriterState {
        self.stop.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while !self.state.lock().unwrap().done && start.elapsed() < timeout {
            std::thread::sleep(Duration::from_millis(50));
        }
        let s = self.snapshot();
        if s.done
            && let Some(t) = self.thread.take()
        {
            let _ = t.join();
        }
        println!(
            "  writer: {} chunks of {} KiB acknowledged, max write+fsync latency {:.2}s, errors {:?}, {}",
            s.chunks.len(),
            CHUNK / 1024,
            s.max_latency.as_secs_f64(),
            s.errors,
            if s.done { "stopped" } else { "STILL BLOCKED" }
        );
        s
    }

    /// Every acknowledged chunk reads back with its checksum (page cache dropped).
    pub(crate) fn verify(&self, state: &WriterState) {
        drop_caches();
        let data =
            fs::read(&self.path).unwrap_or_else(|e| panic!("read {}: {e}", self.path.display()));
        assert!(
            data.len() >= state.chunks.len() * CHUNK,
            "writer file is shorter than the acknowledged chunks"
        );
        for (i, sum) in state.chunks.iter().enumerate() {
            let got: [u8; 32] = Sha256::digest(&data[i * CHUNK..(i + 1) * CHUNK]).into();
            assert_eq!(&got, sum, "writer chunk {i} differs");
        }
        println!(
            "  verified {} acknowledged writer chunks",
            state.chunks.len()
        );
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}
