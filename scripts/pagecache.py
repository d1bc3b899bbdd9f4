#!/usr/bin/env python3
"""Page-cache tools for the demo: `evict DIR...` drops the files' pages (posix_fadvise DONTNEED),
`residency DIR...` prints the share of their pages resident in the page cache (mincore via mmap)."""
import ctypes, mmap, os, sys

libc = ctypes.CDLL("libc.so.6", use_errno=True)
PAGE = os.sysconf("SC_PAGE_SIZE")


def files(dirs):
    for d in dirs:
        for root, _, names in os.walk(d):
            for n in names:
                p = os.path.join(root, n)
                if os.path.isfile(p) and os.path.getsize(p) > 0:
                    yield p


def evict(dirs):
    for p in files(dirs):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def residency(dirs):
    total = resident = 0
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    for p in files(dirs):
        size = os.path.getsize(p)
        with open(p, "rb") as f:
            # A private writable mapping (never written) lets ctypes take its address.
            m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            buf = ctypes.c_char.from_buffer(m)
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
            del buf
            m.close()
            if rc != 0:
                raise OSError(ctypes.get_errno(), "mincore failed on " + p)
            resident += sum(v & 1 for v in vec)
            total += pages
    return 100.0 * resident / total if total else 100.0


if __name__ == "__main__":
    cmd, dirs = sys.argv[1], sys.argv[2:]
    if cmd == "evict":
        evict(dirs)
    elif cmd == "residency":
        print(f"{residency(dirs):.1f}%")
    else:
        sys.exit(f"unknown command {cmd}")
