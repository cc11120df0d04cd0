"""cffi build script (API mode) for the binding to the system liburing.

Run by ``setup.py`` at package build time. The C declarations below are the subset of
liburing that aiopersist uses; cffi checks them against ``<liburing.h>`` when it compiles,
so a mismatch is a build error, not a crash at run time.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from cffi import FFI

CDEF = r"""

struct io_uring { ...; };
struct io_uring_sqe { ...; };
struct io_uring_cqe { uint64_t user_data; int32_t res; uint32_t flags; ...; };

int io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);
void io_uring_queue_exit(struct io_uring *ring);
struct io_uring_sqe *io_uring_get_sqe(struct io_uring *ring);
int io_uring_submit(struct io_uring *ring);

void io_uring_sqe_set_data64(struct io_uring_sqe *sqe, uint64_t data);
void io_uring_prep_nop(struct io_uring_sqe *sqe);
void io_uring_prep_write(struct io_uring_sqe *sqe, int fd, const void *buf, unsigned nbytes, uint64_t offset);
void io_uring_prep_read(struct io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes, uint64_t offset);
void io_uring_prep_fsync(struct io_uring_sqe *sqe, int fd, unsigned fsync_flags);
void io_uring_prep_openat(struct io_uring_sqe *sqe, int dfd, const char *path, int flags, unsigned int mode);
void io_uring_prep_close(struct io_uring_sqe *sqe, int fd);

int io_uring_peek_cqe(struct io_uring *ring, struct io_uring_cqe **cqe_ptr);
int io_uring_wait_cqe(struct io_uring *ring, struct io_uring_cqe **cqe_ptr);
unsigned io_uring_peek_batch_cqe(struct io_uring *ring, struct io_uring_cqe **cqes, unsigned count);
void io_uring_cqe_seen(struct io_uring *ring, struct io_uring_cqe *cqe);
void io_uring_cq_advance(struct io_uring *ring, unsigned nr);

int io_uring_register_eventfd(struct io_uring *ring, int fd);
int io_uring_unregister_eventfd(struct io_uring *ring);

#define IORING_FSYNC_DATASYNC ...
#define IOSQE_ASYNC ...
#define AT_FDCWD ...

struct aiop_dioalign { uint32_t supported; uint32_t mem_align; uint32_t offset_align; };
int aiop_statx_dioalign(int dirfd, const char *path, struct aiop_dioalign *out);
int aiop_io_uring_disabled(void);

extern const char AIOP_LIBURING_VERSION[];
"""

SOURCE_TEMPLATE = r"""
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/stat.h>
#include <liburing.h>

const char AIOP_LIBURING_VERSION[] = "%(version)s";

struct aiop_dioalign { uint32_t supported; uint32_t mem_align; uint32_t offset_align; };

/* statx(STATX_DIOALIGN) through the raw system call, so that an older glibc wrapper
   cannot hide the field. Returns 0 or -errno. supported=0 when the kernel did not
   report direct-I/O alignment for this file (too old, or the file system has none). */
int aiop_statx_dioalign(int dirfd, const char *path, struct aiop_dioalign *out)
{
    memset(out, 0, sizeof(*out));
#if defined(SYS_statx) && defined(STATX_DIOALIGN)
    struct statx stx;
    memset(&stx, 0, sizeof(stx));
    if (syscall(SYS_statx, dirfd, path, 0, STATX_DIOALIGN, &stx) != 0)
        return -errno;
    if ((stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_offset_align != 0) {
        out->supported = 1;
        out->mem_align = stx.stx_dio_mem_align;
        out->offset_align = stx.stx_dio_offset_align;
    }
    return 0;
#else
    (void)dirfd; (void)path;
    return -EOPNOTSUPP;
#endif
}

/* /proc/sys/kernel/io_uring_disabled: 0 allowed, 1 only for a group, 2 off; -1 unknown. */
int aiop_io_uring_disabled(void)
{
    int fd = open("/proc/sys/kernel/io_uring_disabled", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    char c = 0;
    ssize_t n = read(fd, &c, 1);
    close(fd);
    return (n == 1 && c >= '0' && c <= '9') ? c - '0' : -1;
}
"""


def liburing_version() -> str:
    """The version of the liburing we compile against: ``AIOPERSIST_LIBURING_VERSION`` when
    set (a build against unpacked headers, as the GPU check's), else pkg-config's."""
    given = os.environ.get("AIOPERSIST_LIBURING_VERSION", "").strip()
    if given:
        return "".join(c for c in given if c.isalnum() or c in ".-+~")[:40] or "unknown"
    if shutil.which("pkg-config"):
        try:
            out = subprocess.run(
                ["pkg-config", "--modversion", "liburing"], capture_output=True, text=True, check=True
            )
            return out.stdout.strip() or "unknown"
        except (OSError, subprocess.CalledProcessError):
            pass
    return "unknown"


def make_ffi() -> FFI:
    ffibuilder = FFI()
    ffibuilder.cdef(CDEF)
    ffibuilder.set_source(
        "aiopersist._native._liburing",
        SOURCE_TEMPLATE % {"version": liburing_version()},
        libraries=["uring"],
        extra_compile_args=["-O2"],
    )
    return ffibuilder


ffibuilder = make_ffi()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
