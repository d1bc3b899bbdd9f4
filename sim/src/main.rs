//! pghydrate-lazyvol: a FUSE file system that behaves like an EBS volume restored from a snapshot.
//!
//! It passes every operation through to a backing directory. What the backing directory holds when the
//! file system is mounted is "the snapshot": each chunk (512 KiB by default, like EBS snapshot blocks)
//! starts cold. The first read of a cold chunk is a fetch from "S3": it waits `--latency`, at most
//! `--concurrency` fetches run at once, and all fetches share `--bandwidth`. Later reads of the chunk
//! are as fast as the backing disk. Data written after the mount is local, never fetched. An optional
//! background hydration fetches cold chunks slowly, as RDS does on its own.
//!
//! What a real volume behind an instance adds, each off unless given:
//! - `--iops`: every read request the volume serves, cold or not, costs ceil(size / 256 KiB) I/O
//!   operations (as EBS counts SSD I/O), admitted at this many per second: many small requests cost
//!   more than few large ones.
//! - `--throughput-mib`: every read's bytes share this many MiB/s (the instance's EBS bandwidth).
//! - `--burst-seconds` with `--burst-iops` / `--burst-throughput-mib`: those caps hold for the first
//!   seconds after the first read, then the baseline ones (an instance's daily burst, run out).
//! - `--latency-jitter`: each fetch waits `--latency` plus or minus up to this much, uniformly, from a
//!   seeded generator (`--seed`), so a run can be repeated exactly.
//!
//! Mounting again starts all cold (the kernel's page cache goes with the mount). The state is written
//! to `--status` (JSON) every 20 ms: chunks in the snapshot, chunks fetched, bytes fetched. The
//! file system never changes a byte: reads and writes go to the backing files at the same offsets.
//!
//!     pghydrate-lazyvol BACKING MOUNTPOINT --latency 10ms --concurrency 16 --status status.json
//!
//! It runs until SIGTERM/SIGINT or `umount MOUNTPOINT`. Needs root (it mounts with mount(2)).

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig,
    LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, SessionACL, TimeOrNow, WriteFlags,
};

#[derive(Parser, Debug, Clone)]
#[command(about = "A FUSE volume whose first read of each chunk is slow, like an EBS volume restored from a snapshot")]
struct Args {
    /// The directory holding the data (the snapshot's content).
    backing: PathBuf,
    /// Where to mount it.
    mountpoint: PathBuf,
    /// Chunk size in bytes (EBS snapshots: 512 KiB).
    #[arg(long, default_value_t = 512 * 1024)]
    chunk_bytes: u64,
    /// Time to fetch one cold chunk.
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    latency: Duration,
    /// Cold fetches in flight at most.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Fetch bandwidth shared by all fetches, MiB/s (0: no limit).
    #[arg(long, default_value_t = 0.0)]
    bandwidth_mib: f64,
    /// Background hydration: chunks per second fetched on the volume's own (0: none).
    #[arg(long, default_value_t = 0.0)]
    background_chunks_per_second: f64,
    /// I/O operations per second the volume serves (0: no limit). A request of up to 256 KiB is one.
    #[arg(long, default_value_t = 0.0)]
    iops: f64,
    /// MiB/s of every read together, cold or not (0: no limit): the instance's EBS bandwidth.
    #[arg(long, default_value_t = 0.0)]
    throughput_mib: f64,
    /// For this long after the first read, --burst-iops and --burst-throughput-mib hold instead.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    burst_seconds: Duration,
    /// IOPS while the burst lasts (0: --iops).
    #[arg(long, default_value_t = 0.0)]
    burst_iops: f64,
    /// MiB/s while the burst lasts (0: --throughput-mib).
    #[arg(long, default_value_t = 0.0)]
    burst_throughput_mib: f64,
    /// Each fetch waits --latency plus or minus up to this much (uniform).
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    latency_jitter: Duration,
    /// Seed of the jitter's generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// JSON status file, rewritten every 20 ms.
    #[arg(long)]
    status: Option<PathBuf>,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 32)]
    threads: usize,
}

const TTL: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, PartialEq)]
enum Chunk {
    Cold,
    Fetching,
    Hot,
}

/// The snapshot's chunks, by backing file (device, inode): stable across renames.
struct Chunks {
    files: HashMap<(u64, u64), Vec<Chunk>>,
    in_flight: usize,
}

struct Stats {
    total_chunks: u64,
    /// Cold chunks of snapshot files deleted, replaced or truncated away: they can never be fetched.
    discarded_chunks: AtomicU64,
    fetched_chunks: AtomicU64,
    fetched_bytes: AtomicU64,
    reads: AtomicU64,
    cold_reads: AtomicU64,
    /// I/O operations counted against --iops (ceil(size / 256 KiB) per read request).
    io_ops: AtomicU64,
    read_bytes: AtomicU64,
    /// Microseconds read requests waited for the IOPS and throughput caps, summed.
    paced_us: AtomicU64,
    started: Instant,
    started_unix: f64,
}

struct Lazy {
    args: Args,
    chunks: Mutex<Chunks>,
    changed: Condvar,
    /// Bandwidth schedule: when the shared link is free again.
    link_free_at: Mutex<Instant>,
    /// The volume's own caps (IOPS, throughput, burst).
    pacer: Mutex<Pacer>,
    /// The jitter's generator (xorshift64*).
    rng: Mutex<u64>,
    stats: Stats,
    inodes: RwLock<Inodes>,
    handles: Mutex<HashMap<u64, Arc<File>>>,
    next_fh: AtomicU64,
}

/// When the volume's IOPS and throughput schedules are free again, and when the first read came
/// (the burst's start).
struct Pacer {
    ops_free_at: Instant,
    bytes_free_at: Instant,
    first_read: Option<Instant>,
}

/// An EBS I/O operation: up to 256 KiB on SSD volumes.
const IO_OP_BYTES: u64 = 256 * 1024;

#[derive(Default)]
struct Inodes {
    by_ino: HashMap<u64, PathBuf>,
    by_path: HashMap<PathBuf, u64>,
    next: u64,
}

impl Inodes {
    fn ino_of(&mut self, rel: &Path) -> u64 {
        if let Some(i) = self.by_path.get(rel) {
            return *i;
        }
        self.next += 1;
        let i = self.next;
        self.by_ino.insert(i, rel.to_path_buf());
        self.by_path.insert(rel.to_path_buf(), i);
        i
    }

    fn renamed(&mut self, from: &Path, to: &Path) {
        let moved: Vec<(PathBuf, u64)> =
            self.by_path.iter().filter(|(p, _)| p.starts_with(from)).map(|(p, i)| (p.clone(), *i)).collect();
        if let Some(i) = self.by_path.remove(to) {
            self.by_ino.remove(&i);
        }
        for (p, i) in moved {
            let rest = p.strip_prefix(from).unwrap();
            // (joining an empty path would append a separator: "a/b" + "" = "a/b/")
            let np = if rest.as_os_str().is_empty() { to.to_path_buf() } else { to.join(rest) };
            self.by_path.remove(&p);
            self.by_path.insert(np.clone(), i);
            self.by_ino.insert(i, np);
        }
    }
}

fn errno(e: io::Error) -> Errno {
    Errno::from(e)
}

fn to_time(secs: i64, nsecs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
    } else {
        UNIX_EPOCH
    }
}

fn attr_of(ino: u64, m: &fs::Metadata) -> FileAttr {
    let kind = if m.is_dir() {
        FileType::Directory
    } else if m.file_type().is_symlink() {
        FileType::Symlink
    } else {
        FileType::RegularFile
    };
    FileAttr {
        ino: INodeNo(ino),
        size: m.size(),
        blocks: m.blocks(),
        atime: to_time(m.atime(), m.atime_nsec()),
        mtime: to_time(m.mtime(), m.mtime_nsec()),
        ctime: to_time(m.ctime(), m.ctime_nsec()),
        crtime: UNIX_EPOCH,
        kind,
        perm: (m.mode() & 0o7777) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: m.rdev() as u32,
        blksize: 4096,
        flags: 0,
    }
}

impl Lazy {
    fn new(args: Args) -> io::Result<Lazy> {
        let mut files = HashMap::new();
        let mut total = 0;
        let mut stack = vec![args.backing.clone()];
        while let Some(dir) = stack.pop() {
            for e in fs::read_dir(&dir)? {
                let e = e?;
                let m = fs::symlink_metadata(e.path())?;
                if m.is_dir() {
                    stack.push(e.path());
                } else if m.is_file() {
                    let n = m.size().div_ceil(args.chunk_bytes);
                    total += n;
                    files.insert((m.dev(), m.ino()), vec![Chunk::Cold; n as usize]);
                }
            }
        }
        let mut inodes = Inodes { next: 1, ..Default::default() };
        inodes.by_ino.insert(1, PathBuf::new());
        inodes.by_path.insert(PathBuf::new(), 1);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
        let seed = args.seed.max(1);
        Ok(Lazy {
            args,
            chunks: Mutex::new(Chunks { files, in_flight: 0 }),
            changed: Condvar::new(),
            link_free_at: Mutex::new(Instant::now()),
            pacer: Mutex::new(Pacer { ops_free_at: Instant::now(), bytes_free_at: Instant::now(), first_read: None }),
            rng: Mutex::new(seed),
            stats: Stats {
                total_chunks: total,
                discarded_chunks: AtomicU64::new(0),
                fetched_chunks: AtomicU64::new(0),
                fetched_bytes: AtomicU64::new(0),
                reads: AtomicU64::new(0),
                cold_reads: AtomicU64::new(0),
                io_ops: AtomicU64::new(0),
                read_bytes: AtomicU64::new(0),
                paced_us: AtomicU64::new(0),
                started: Instant::now(),
                started_unix: now,
            },
            inodes: RwLock::new(inodes),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
        })
    }

    fn rel(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        self.inodes.read().unwrap().by_ino.get(&ino.0).cloned().ok_or(Errno::ENOENT)
    }

    fn full(&self, rel: &Path) -> PathBuf {
        self.args.backing.join(rel)
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<PathBuf, Errno> {
        Ok(self.rel(parent)?.join(name))
    }

    fn entry(&self, rel: &Path) -> Result<FileAttr, Errno> {
        let m = fs::symlink_metadata(self.full(rel)).map_err(errno)?;
        let ino = self.inodes.write().unwrap().ino_of(rel);
        Ok(attr_of(ino, &m))
    }

    /// The backing file at `full` is going away (unlink, replaced by a rename) or is cut to `keep`
    /// bytes: its cold chunks past that point leave the snapshot.
    fn discard(&self, full: &Path, keep: u64) {
        let Ok(m) = fs::symlink_metadata(full) else { return };
        if !m.is_file() {
            return;
        }
        let key = (m.dev(), m.ino());
        let mut c = self.chunks.lock().unwrap();
        if let Some(states) = c.files.get_mut(&key) {
            let from = (keep.div_ceil(self.args.chunk_bytes) as usize).min(states.len());
            let cold = states[from..].iter().filter(|s| **s == Chunk::Cold).count() as u64;
            states.truncate(from);
            self.stats.discarded_chunks.fetch_add(cold, Ordering::Relaxed);
        }
    }

    /// The caps in force at `now`: (IOPS, bytes per second), each 0 for none.
    fn caps(&self, first_read: Instant, now: Instant) -> (f64, f64) {
        let a = &self.args;
        let bursting = now < first_read + a.burst_seconds;
        let iops = if bursting && a.burst_iops > 0.0 { a.burst_iops } else { a.iops };
        let mib = if bursting && a.burst_throughput_mib > 0.0 { a.burst_throughput_mib } else { a.throughput_mib };
        (iops, mib * 1048576.0)
    }

    /// Admits a read request of `size` bytes under the volume's IOPS and throughput caps: it waits
    /// for its turn in the I/O schedule and until its bytes have passed the shared throughput.
    fn pace(&self, size: u64) {
        let ops = size.div_ceil(IO_OP_BYTES).max(1);
        self.stats.io_ops.fetch_add(ops, Ordering::Relaxed);
        self.stats.read_bytes.fetch_add(size, Ordering::Relaxed);
        let until = {
            let mut p = self.pacer.lock().unwrap();
            let now = Instant::now();
            let first = *p.first_read.get_or_insert(now);
            let (iops, bytes_per_second) = self.caps(first, now);
            let mut until = now;
            if iops > 0.0 {
                let start = p.ops_free_at.max(now);
                p.ops_free_at = start + Duration::from_secs_f64(ops as f64 / iops);
                until = until.max(start);
            }
            if bytes_per_second > 0.0 {
                let start = p.bytes_free_at.max(now);
                p.bytes_free_at = start + Duration::from_secs_f64(size as f64 / bytes_per_second);
                until = until.max(p.bytes_free_at);
            }
            until
        };
        let wait = until.saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            self.stats.paced_us.fetch_add(wait.as_micros() as u64, Ordering::Relaxed);
            std::thread::sleep(wait);
        }
    }

    /// One fetch's latency: --latency plus or minus up to --latency-jitter, uniformly.
    fn fetch_latency(&self) -> Duration {
        let jitter = self.args.latency_jitter.as_secs_f64();
        if jitter == 0.0 {
            return self.args.latency;
        }
        let u = {
            let mut x = self.rng.lock().unwrap();
            *x ^= *x >> 12;
            *x ^= *x << 25;
            *x ^= *x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
        };
        Duration::from_secs_f64((self.args.latency.as_secs_f64() + (2.0 * u - 1.0) * jitter).max(0.0))
    }

    /// Fetches the cold chunks among `first..=last` of the backing file `key`: waits for fetches of
    /// the same chunks by others, starts its own under the concurrency cap and the bandwidth schedule.
    fn hydrate(&self, key: (u64, u64), first: u64, last: u64) {
        let mut mine = Vec::new();
        {
            let mut c = self.chunks.lock().unwrap();
            loop {
                let Some(states) = c.files.get(&key) else { return };
                let end = (last as usize + 1).min(states.len());
                if first as usize >= end {
                    return;
                }
                let fetching = (first as usize..end).any(|i| states[i] == Chunk::Fetching);
                let cold: Vec<usize> = (first as usize..end).filter(|i| states[*i] == Chunk::Cold).collect();
                if cold.is_empty() && !fetching {
                    return;
                }
                if !cold.is_empty() && c.in_flight < self.args.concurrency {
                    let take = cold.len().min(self.args.concurrency - c.in_flight);
                    let states = c.files.get_mut(&key).unwrap();
                    for i in &cold[..take] {
                        states[*i] = Chunk::Fetching;
                    }
                    mine.extend_from_slice(&cold[..take]);
                    c.in_flight += take;
                    break;
                }
                c = self.changed.wait(c).unwrap();
            }
        }
        // Fetch what this request took (in parallel with every other request's fetches).
        let bytes = mine.len() as u64 * self.args.chunk_bytes;
        let mut until = Instant::now() + self.fetch_latency();
        if self.args.bandwidth_mib > 0.0 {
            let transfer = Duration::from_secs_f64(bytes as f64 / (self.args.bandwidth_mib * 1048576.0));
            let mut link = self.link_free_at.lock().unwrap();
            let start = (*link).max(Instant::now());
            *link = start + transfer;
            until = until.max(*link);
        }
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
        {
            let mut c = self.chunks.lock().unwrap();
            if let Some(states) = c.files.get_mut(&key) {
                for i in &mine {
                    states[*i] = Chunk::Hot;
                }
            }
            c.in_flight -= mine.len();
        }
        self.stats.fetched_chunks.fetch_add(mine.len() as u64, Ordering::Relaxed);
        self.stats.fetched_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.changed.notify_all();
        // Chunks others were fetching, or left cold because the cap was full: go round again.
        self.hydrate(key, first, last);
    }

    fn status_json(&self) -> serde_json::Value {
        let fetched = self.stats.fetched_chunks.load(Ordering::Relaxed);
        let discarded = self.stats.discarded_chunks.load(Ordering::Relaxed);
        let fetchable = self.stats.total_chunks - discarded;
        serde_json::json!({
            "chunk_bytes": self.args.chunk_bytes,
            "latency_ms": self.args.latency.as_secs_f64() * 1000.0,
            "concurrency": self.args.concurrency,
            "bandwidth_mib": self.args.bandwidth_mib,
            "iops": self.args.iops,
            "throughput_mib": self.args.throughput_mib,
            "burst_seconds": self.args.burst_seconds.as_secs_f64(),
            "burst_iops": self.args.burst_iops,
            "burst_throughput_mib": self.args.burst_throughput_mib,
            "latency_jitter_ms": self.args.latency_jitter.as_secs_f64() * 1000.0,
            "seed": self.args.seed,
            "total_chunks": self.stats.total_chunks,
            "fetched_chunks": fetched,
            "fetched_bytes": self.stats.fetched_bytes.load(Ordering::Relaxed),
            "discarded_chunks": discarded,
            // Fetched over what can still be fetched: chunks of files deleted or truncated do not count.
            "hydrated": if fetchable == 0 { 1.0 } else { fetched as f64 / fetchable as f64 },
            "reads": self.stats.reads.load(Ordering::Relaxed),
            "cold_reads": self.stats.cold_reads.load(Ordering::Relaxed),
            "io_ops": self.stats.io_ops.load(Ordering::Relaxed),
            "read_bytes": self.stats.read_bytes.load(Ordering::Relaxed),
            "paced_seconds": self.stats.paced_us.load(Ordering::Relaxed) as f64 / 1e6,
            "first_read_unix": self.pacer.lock().unwrap().first_read.map(|f| {
                self.stats.started_unix + f.saturating_duration_since(self.stats.started).as_secs_f64()
            }),
            "mounted_unix": self.stats.started_unix,
            "seconds": self.stats.started.elapsed().as_secs_f64(),
        })
    }

    fn background(self: &Arc<Self>) {
        let per_second = self.args.background_chunks_per_second;
        if per_second <= 0.0 {
            return;
        }
        let me = self.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_secs_f64(1.0 / per_second));
            let next = {
                let c = me.chunks.lock().unwrap();
                c.files.iter().find_map(|(k, v)| v.iter().position(|s| *s == Chunk::Cold).map(|i| (*k, i as u64)))
            };
            match next {
                Some((key, i)) => me.hydrate(key, i, i),
                None => return,
            }
        });
    }
}

struct Fs(Arc<Lazy>);

impl Filesystem for Fs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let _ = config.set_max_background(256);
        let _ = config.set_congestion_threshold(192);
        let _ = config.set_max_readahead(1 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.0.child(parent, name).and_then(|p| self.0.entry(&p)) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.0.rel(ino).and_then(|p| self.0.entry(&p)) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = (|| -> Result<FileAttr, Errno> {
            let rel = self.0.rel(ino)?;
            let full = self.0.full(&rel);
            if let Some(m) = mode {
                fs::set_permissions(&full, fs::Permissions::from_mode(m & 0o7777)).map_err(errno)?;
            }
            if uid.is_some() || gid.is_some() {
                std::os::unix::fs::chown(&full, uid, gid).map_err(errno)?;
            }
            if let Some(s) = size {
                self.0.discard(&full, s);
                self.0.discard(&full, s);
                OpenOptions::new().write(true).open(&full).and_then(|f| f.set_len(s)).map_err(errno)?;
            }
            self.0.entry(&rel)
        })();
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let r = (|| -> Result<FileAttr, Errno> {
            let rel = self.0.child(parent, name)?;
            let full = self.0.full(&rel);
            fs::DirBuilder::new().mode(mode & !umask & 0o7777).create(&full).map_err(errno)?;
            std::os::unix::fs::chown(&full, Some(req.uid()), Some(req.gid())).map_err(errno)?;
            self.0.entry(&rel)
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let gone = |rel: PathBuf| {
            let full = self.0.full(&rel);
            self.0.discard(&full, 0);
            fs::remove_file(full).map_err(errno)
        };
        match self.0.child(parent, name).and_then(gone) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.0.child(parent, name).and_then(|rel| fs::remove_dir(self.0.full(&rel)).map_err(errno)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = (|| -> Result<(), Errno> {
            let from = self.0.child(parent, name)?;
            let to = self.0.child(newparent, newname)?;
            self.0.discard(&self.0.full(&to), 0);
            fs::rename(self.0.full(&from), self.0.full(&to)).map_err(errno)?;
            self.0.inodes.write().unwrap().renamed(&from, &to);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = (|| -> Result<u64, Errno> {
            let full = self.0.full(&self.0.rel(ino)?);
            let acc = flags.0 & libc_o::ACCMODE;
            let f = OpenOptions::new()
                .read(acc != libc_o::WRONLY)
                .write(acc != libc_o::RDONLY)
                .open(&full)
                .map_err(errno)?;
            let fh = self.0.next_fh.fetch_add(1, Ordering::Relaxed);
            self.0.handles.lock().unwrap().insert(fh, Arc::new(f));
            Ok(fh)
        })();
        match r {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let r = (|| -> Result<(FileAttr, u64), Errno> {
            let rel = self.0.child(parent, name)?;
            let full = self.0.full(&rel);
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(flags & libc_o::TRUNC != 0)
                .custom_flags(flags & libc_o::EXCL)
                .mode(mode & !umask & 0o7777)
                .open(&full)
                .map_err(errno)?;
            std::os::unix::fs::chown(&full, Some(req.uid()), Some(req.gid())).map_err(errno)?;
            let fh = self.0.next_fh.fetch_add(1, Ordering::Relaxed);
            self.0.handles.lock().unwrap().insert(fh, Arc::new(f));
            Ok((self.0.entry(&rel)?, fh))
        })();
        match r {
            Ok((a, fh)) => reply.created(&TTL, &a, Generation(0), FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(f) = self.0.handles.lock().unwrap().get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        self.0.stats.reads.fetch_add(1, Ordering::Relaxed);
        if size > 0 {
            self.0.pace(size as u64);
            if let Ok(m) = f.metadata() {
                let key = (m.dev(), m.ino());
                let first = offset / self.0.args.chunk_bytes;
                let last = (offset + size as u64 - 1) / self.0.args.chunk_bytes;
                let cold = {
                    let c = self.0.chunks.lock().unwrap();
                    c.files.get(&key).is_some_and(|v| {
                        (first as usize..=(last as usize).min(v.len().saturating_sub(1)))
                            .any(|i| i < v.len() && v[i] != Chunk::Hot)
                    })
                };
                if cold {
                    self.0.stats.cold_reads.fetch_add(1, Ordering::Relaxed);
                    self.0.hydrate(key, first, last);
                }
            }
        }
        let mut buf = vec![0u8; size as usize];
        let mut got = 0;
        while got < buf.len() {
            match f.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return reply.error(errno(e)),
            }
        }
        reply.data(&buf[..got]);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(f) = self.0.handles.lock().unwrap().get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        match f.write_all_at(data, offset) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.0.handles.lock().unwrap().remove(&fh.0);
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let Some(f) = self.0.handles.lock().unwrap().get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        match if datasync { f.sync_data() } else { f.sync_all() } {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let r = (|| -> Result<Vec<(u64, FileType, OsString)>, Errno> {
            let rel = self.0.rel(ino)?;
            let mut out =
                vec![(ino.0, FileType::Directory, OsString::from(".")), (1, FileType::Directory, "..".into())];
            let mut entries: Vec<_> = fs::read_dir(self.0.full(&rel)).map_err(errno)?.filter_map(|e| e.ok()).collect();
            entries.sort_by_key(|e| e.file_name());
            for e in entries {
                let child = rel.join(e.file_name());
                let kind = match e.file_type() {
                    Ok(t) if t.is_dir() => FileType::Directory,
                    Ok(t) if t.is_symlink() => FileType::Symlink,
                    _ => FileType::RegularFile,
                };
                let i = self.0.inodes.write().unwrap().ino_of(&child);
                out.push((i, kind, e.file_name()));
            }
            Ok(out)
        })();
        match r {
            Ok(entries) => {
                for (n, (i, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(i), (n + 1) as u64, kind, name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.0.rel(ino).and_then(|rel| File::open(self.0.full(&rel)).and_then(|d| d.sync_all()).map_err(errno)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(1 << 30, 1 << 29, 1 << 29, 1 << 20, 1 << 19, 4096, 255, 4096);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok(); // default_permissions: the kernel checks
    }
}

/// open(2) flag values (Linux), to avoid a libc dependency.
mod libc_o {
    pub const ACCMODE: i32 = 0o3;
    pub const RDONLY: i32 = 0o0;
    pub const WRONLY: i32 = 0o1;
    pub const EXCL: i32 = 0o200;
    pub const TRUNC: i32 = 0o1000;
}

fn main() {
    let args = Args::parse();
    let signals = block_signals(); // before any thread starts: every thread inherits the mask
    if args.concurrency == 0 || args.chunk_bytes == 0 {
        eprintln!("pghydrate-lazyvol: --concurrency and --chunk-bytes must be positive");
        std::process::exit(2);
    }
    let rates = [args.bandwidth_mib, args.iops, args.throughput_mib, args.burst_iops, args.burst_throughput_mib];
    if rates.iter().any(|r| !r.is_finite() || *r < 0.0) {
        eprintln!(
            "pghydrate-lazyvol: rates (--bandwidth-mib, --iops, --throughput-mib, --burst-*) must be 0 or positive"
        );
        std::process::exit(2);
    }
    if args.latency_jitter > args.latency {
        eprintln!("pghydrate-lazyvol: --latency-jitter may not exceed --latency");
        std::process::exit(2);
    }
    let lazy = match Lazy::new(args.clone()) {
        Ok(l) => Arc::new(l),
        Err(e) => {
            eprintln!("pghydrate-lazyvol: cannot read the backing directory {}: {e}", args.backing.display());
            std::process::exit(2);
        }
    };
    eprintln!(
        "pghydrate-lazyvol: {} chunks of {} KiB cold under {} (latency {:?} +- {:?}, {} fetches at once, fetch bandwidth {}, \
         volume {} IOPS, {} MiB/s, burst {:?} at {} IOPS, {} MiB/s)",
        lazy.stats.total_chunks,
        args.chunk_bytes / 1024,
        args.mountpoint.display(),
        args.latency,
        args.latency_jitter,
        args.concurrency,
        if args.bandwidth_mib > 0.0 { format!("{} MiB/s", args.bandwidth_mib) } else { "unlimited".into() },
        args.iops,
        args.throughput_mib,
        args.burst_seconds,
        args.burst_iops,
        args.burst_throughput_mib,
    );
    if let Some(path) = args.status.clone() {
        let me = lazy.clone();
        std::thread::spawn(move || loop {
            let tmp = path.with_extension("tmp");
            if fs::write(&tmp, me.status_json().to_string()).is_ok() {
                let _ = fs::rename(&tmp, &path);
            }
            std::thread::sleep(Duration::from_millis(20));
        });
    }
    lazy.background();
    let mut config = Config::default();
    config.mount_options = vec![MountOption::FSName("pghydrate-lazyvol".into()), MountOption::DefaultPermissions];
    config.acl = SessionACL::All;
    config.n_threads = Some(args.threads);
    config.clone_fd = true;
    let session = match fuser::spawn_mount(Fs(lazy.clone()), &args.mountpoint, &config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("pghydrate-lazyvol: cannot mount {}: {e}", args.mountpoint.display());
            std::process::exit(1);
        }
    };
    // The kernel starts the root with the mounter's owner (root); one stat loads the backing root's
    // attributes, so the server's user may chmod it (CREATE TABLESPACE does).
    let _ = fs::metadata(&args.mountpoint);
    // Until SIGTERM/SIGINT: then unmount.
    wait_for_signal(&signals);
    drop(session);
    if let Some(path) = &args.status {
        let _ = fs::write(path, lazy.status_json().to_string());
    }
}

extern "C" {
    fn sigemptyset(set: *mut [u64; 16]) -> i32;
    fn sigaddset(set: *mut [u64; 16], sig: i32) -> i32;
    fn pthread_sigmask(how: i32, set: *const [u64; 16], old: *mut [u64; 16]) -> i32;
    fn sigwait(set: *const [u64; 16], sig: *mut i32) -> i32;
}

/// Blocks SIGTERM and SIGINT in this thread (and so in every thread started later).
fn block_signals() -> [u64; 16] {
    let mut set = [0u64; 16];
    // SAFETY: sigset_t is at most 128 bytes on Linux; the calls only touch that buffer.
    unsafe {
        sigemptyset(&mut set);
        sigaddset(&mut set, 15);
        sigaddset(&mut set, 2);
        pthread_sigmask(0 /* SIG_BLOCK */, &set, std::ptr::null_mut());
    }
    set
}

/// Waits for SIGTERM or SIGINT.
fn wait_for_signal(set: &[u64; 16]) {
    let mut sig = 0;
    // SAFETY: as above.
    unsafe {
        sigwait(set, &mut sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lazy(extra: &[&str]) -> Lazy {
        let dir = std::env::temp_dir().join(format!("lazyvol-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let d = dir.to_str().unwrap();
        let mut argv = vec!["pghydrate-lazyvol", d, d];
        argv.extend_from_slice(extra);
        Lazy::new(Args::parse_from(argv)).unwrap()
    }

    #[test]
    fn fetch_latency_jitters_within_its_bounds_and_repeats_with_its_seed() {
        let draw = |seed: &str| {
            let l = lazy(&["--latency", "20ms", "--latency-jitter", "10ms", "--seed", seed]);
            (0..2000).map(|_| l.fetch_latency().as_secs_f64() * 1000.0).collect::<Vec<f64>>()
        };
        let a = draw("7");
        assert!(a.iter().all(|ms| (10.0..=30.0).contains(ms)), "outside 20 +- 10 ms");
        let mean = a.iter().sum::<f64>() / a.len() as f64;
        assert!((mean - 20.0).abs() < 1.0, "mean {mean}");
        assert!(a.iter().any(|ms| *ms < 12.0) && a.iter().any(|ms| *ms > 28.0), "spread over the whole range");
        assert_eq!(a, draw("7"), "the same seed, the same latencies");
        assert_ne!(a, draw("8"));
        let flat = lazy(&["--latency", "20ms"]);
        assert_eq!(flat.fetch_latency(), Duration::from_millis(20));
    }

    #[test]
    fn caps_switch_from_burst_to_baseline() {
        let l = lazy(&["--iops", "100", "--throughput-mib", "10", "--burst-seconds", "2s", "--burst-iops", "1000"]);
        let t0 = Instant::now();
        assert_eq!(l.caps(t0, t0 + Duration::from_secs(1)), (1000.0, 10.0 * 1048576.0), "burst IOPS, baseline MiB/s");
        assert_eq!(l.caps(t0, t0 + Duration::from_secs(3)), (100.0, 10.0 * 1048576.0));
    }
}
