"""glibc's fixed heap thresholds: which blocks come back as fresh pages (a subprocess, no ranks)."""

import platform
import subprocess
import sys

import pytest

from commlab._malloc import MMAP_THRESHOLD

# Allocate, write, free, allocate and write again; print the page faults of the second round.
# In a subprocess: the thresholds stay set for the life of the process that sets them.
SCRIPT = """
import ctypes, resource, sys
from commlab._malloc import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
print(keep_freed_memory())
for n in map(int, sys.argv[1:]):
    block = libc.malloc(n); ctypes.memset(block, 1, n); libc.free(block)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(n); ctypes.memset(block, 1, n)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(block)
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc only")
def test_with_fixed_thresholds_only_blocks_over_the_mmap_threshold_fault_again():
    small, large = MMAP_THRESHOLD // 2, MMAP_THRESHOLD + (4 << 20)  # 16 MiB: a trunk's; 36 MiB: a head's
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(small), str(large)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "True"
    pages = large // 4096
    assert int(out[1]) < 64  # taken back from the heap: already touched
    assert int(out[2]) > pages // 2  # mmapped anew: every page faulted again (huge pages would fault fewer)
