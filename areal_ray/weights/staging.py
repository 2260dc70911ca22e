"""Where weight files go on a node: shared memory while it has room, else the temp dir.

Shared memory is small in containers (Docker gives /dev/shm 64 MB unless run with
`--shm-size`), and a file there that outgrows it fails with ENOSPC, or with SIGBUS when
a mapped page is first written. So every weight file written to shared memory (the shm
path's, and the file a vLLM replica loads from) first asks `staging_dir` where it fits.
Torch-free: the clean-up sweep (cluster/cleanup.py) lists the same dirs on every node.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Room left free in /dev/shm besides a file: every replica and the trainer of a node
# write there, each checking the space on its own, so none may take the last bytes.
SHM_MARGIN = 64 << 20


def shm_dir() -> Path:
    """Where weight files shared between processes of one node go: memory-backed
    /dev/shm where it exists, else the temp dir."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else disk_dir()


def disk_dir() -> Path:
    """The temp dir (TMPDIR): where weight files go when shared memory is too small."""
    return Path(tempfile.gettempdir())


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem holding `path`."""
    return shutil.disk_usage(path).free


_fell_back: set[Path] = set()  # shared-memory dirs this process already warned about


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def staging_dir(nbytes: int) -> Path:
    """Where a weight file of `nbytes` goes: `shm_dir()` while it has room for the file
    plus `SHM_MARGIN`, else `disk_dir()` (slower, but a full tmpfs fails with ENOSPC or
    kills the writer with SIGBUS). Raises OSError before anything is written when
    neither has room."""
    need = nbytes + SHM_MARGIN
    shm = shm_dir()
    free = free_bytes(shm)
    if free >= need:
        return shm
    disk = disk_dir()
    if disk == shm or free_bytes(disk) < need:
        raise OSError(28, f"no room for a {_gib(nbytes)} weight file: {shm} has {_gib(free)} "
                          f"free and {disk} has {_gib(free_bytes(disk))}")
    if shm not in _fell_back:
        _fell_back.add(shm)
        logger.warning(
            "%s has %s free, a weight file needs %s (plus %s margin): weight files go to %s "
            "on disk instead, which is slower. Give the container more shared memory "
            "(Docker: `--shm-size=16g`; Kubernetes: a memory-backed emptyDir at /dev/shm), "
            "or set TMPDIR to choose the disk dir.",
            shm, _gib(free), _gib(nbytes), _gib(SHM_MARGIN), disk)
    return disk


def shm_has_room(nbytes: int) -> bool:
    """Whether shared memory has room for `nbytes` more (plus `SHM_MARGIN`); nothing
    to share always fits."""
    return nbytes <= 0 or free_bytes(shm_dir()) >= nbytes + SHM_MARGIN


def check_shm_room(nbytes: int, what: str) -> None:
    """Raise a clear OSError (ENOSPC) unless shared memory has room for `nbytes`, for
    what has no disk fallback: torch's sharing of a CPU tensor with another process
    (its file-descriptor strategy) always puts the storage into /dev/shm."""
    if shm_has_room(nbytes):
        return
    shm = shm_dir()
    raise OSError(28, f"{what} needs {_gib(nbytes)} of shared memory in {shm} (torch shares "
                      f"CPU tensors between processes there), which has "
                      f"{_gib(free_bytes(shm))} free and keeps {_gib(SHM_MARGIN)} spare: give "
                      "the container more shared memory (Docker: `--shm-size=16g`; "
                      "Kubernetes: a memory-backed emptyDir at /dev/shm)")


def weight_dirs() -> list[Path]:
    """Every dir `staging_dir` may pick, each once."""
    return list(dict.fromkeys([shm_dir(), disk_dir()]))
