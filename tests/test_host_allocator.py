"""The host allocator setting of CPU runs (executor/platform/host_allocator.py): applied on glibc
unless the user chose otherwise through glibc's variables or a preloaded allocator."""

from __future__ import annotations

import ctypes.util

import pytest

from executor.platform.host_allocator import keep_freed_host_memory


@pytest.mark.parametrize(
    "environ",
    [{"MALLOC_MMAP_MAX_": "65536"}, {"MALLOC_TRIM_THRESHOLD_": "0"}, {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}],
)
def test_a_users_own_allocator_choice_is_kept(environ):
    assert keep_freed_host_memory(environ) is False


def test_glibc_takes_the_setting():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert hasattr(libc, "gnu_get_libc_version"), "this test machine runs glibc"
    assert keep_freed_host_memory({}) is True
