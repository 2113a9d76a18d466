"""`KernelLaunch`: which compiled kernels it takes, and the parameters it hands the driver;
`CompiledKernel`: which of the two launches it makes.

No GPU here, so the driver's `cuLaunchKernel` is a C callback that reads the parameter
array as the driver would (each entry a pointer to a value of the size the driver
reported for that parameter); a real launch of the same kernels is checked against
Triton's in `tests/gpu/test_paged_kv.py` and `tests/gpu/test_cuda_ipc.py`.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest

from workers.transports.cuda_driver import CompiledKernel, KernelLaunch

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p)


class _Driver:
    """The two calls `KernelLaunch` makes, with a launch that records what it was given."""

    def __init__(self, sizes: list[int] | None, rc: int = 0) -> None:
        self.sizes, self.rc = sizes, rc
        self.launches: list[dict[str, Any]] = []

        def launch(function: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, stream: int,
                   params: int, extra: int) -> int:
            slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            values = []
            for i, size in enumerate(self.sizes or []):
                kind = ctypes.c_uint64 if size == 8 else ctypes.c_uint32
                values.append(ctypes.cast(slots[i], ctypes.POINTER(kind)).contents.value)
            self.launches.append({"function": function, "grid": (gx, gy, gz), "block": (bx, by, bz),
                                  "shared": shared, "stream": stream or 0, "params": values, "extra": extra})
            return self.rc

        self._callback = _LAUNCH(launch)  # kept alive as long as the driver
        self._fns = {"cuLaunchKernel": self._callback}

    def param_sizes(self, function: int) -> list[int] | None:
        return self.sizes

    def fail(self, name: str, rc: int) -> None:
        raise RuntimeError(f"{name} failed: CUDA error {rc}")


def _kernel(**meta: Any) -> SimpleNamespace:
    return SimpleNamespace(function=0xBEEF, metadata=SimpleNamespace(**{"num_warps": 16, "shared": 96, **meta}))


def test_a_launch_hands_each_parameter_at_the_size_the_driver_reported() -> None:
    # Three run-time arguments (an address, a 32-bit and a 64-bit int), then the two
    # scratch pointers Triton appends, which go as null.
    drv = _Driver([8, 4, 8, 8, 8])
    launch = KernelLaunch.make(drv, _kernel(), 3)  # type: ignore[arg-type]
    assert launch is not None
    launch(7, 0x1234, (0x7F00_0000_1000, 41, -1))
    (got,) = drv.launches
    assert got["function"] == 0xBEEF and got["grid"] == (7, 1, 1) and got["block"] == (16 * 32, 1, 1)
    assert got["shared"] == 96 and got["stream"] == 0x1234 and not got["extra"]
    assert got["params"] == [0x7F00_0000_1000, 41, (1 << 64) - 1, 0, 0]


def test_a_failed_launch_raises_what_the_driver_said() -> None:
    drv = _Driver([8, 8], rc=700)
    launch = KernelLaunch.make(drv, _kernel(), 1)  # type: ignore[arg-type]
    assert launch is not None
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA error 700"):
        launch(1, 0, (5,))


@pytest.mark.parametrize(
    ("sizes", "meta", "why"),
    [
        (None, {}, "a driver before CUDA 12.4 cannot list the parameters"),
        ([8, 8], {}, "fewer parameters than run-time arguments: another kernel"),
        ([8, 8, 8, 4], {}, "a trailing parameter that is not a pointer"),
        ([8, 8, 8, 16], {}, "a parameter by value of another size"),
        ([8, 8, 8, 8], {"num_ctas": 2}, "a cluster launch"),
        ([8, 8, 8, 8], {"shared": 229 * 1024}, "oversized shared memory"),
        ([8, 8, 8, 8], {"global_scratch_size": 256}, "scratch memory to allocate"),
        ([8, 8, 8, 8], {"profile_scratch_size": 64}, "a profiler's scratch"),
        ([8, 8, 8, 8], {"launch_pdl": True}, "a dependent launch"),
        ([8, 8, 8, 8], {"launch_cooperative_grid": True}, "a cooperative launch"),
    ],
)
def test_a_kernel_that_needs_more_than_a_plain_launch_stays_with_tritons(sizes: list[int] | None,
                                                                        meta: dict[str, Any], why: str) -> None:
    assert KernelLaunch.make(_Driver(sizes), _kernel(**meta), 3) is None, why  # type: ignore[arg-type]


def test_no_driver_no_launch() -> None:
    assert KernelLaunch.make(None, _kernel(), 3) is None


class _TritonKernel(SimpleNamespace):
    """A compiled kernel whose own launcher records its arguments."""

    def run(self, *args: Any) -> None:
        self.runs.append(args)


def _triton_kernel(**meta: Any) -> _TritonKernel:
    return _TritonKernel(function=0xBEEF, packed_metadata="packed", runs=[],
                         metadata=SimpleNamespace(**{"num_warps": 16, "shared": 96, **meta}))


def test_a_compiled_kernel_launches_through_the_driver_where_it_can() -> None:
    drv, kernel = _Driver([8, 4, 8]), _triton_kernel()
    compiled = CompiledKernel(kernel, 2, drv)  # type: ignore[arg-type]
    compiled(3, 0x99, (0x7F00_0000_2000, 12), ("BLOCK", 1024))
    assert compiled.kept is not None and not kernel.runs
    (got,) = drv.launches
    assert got["grid"] == (3, 1, 1) and got["stream"] == 0x99 and got["params"] == [0x7F00_0000_2000, 12, 0]


@pytest.mark.parametrize("drv", [None, _Driver(None), _Driver([8, 8, 8])], ids=["no driver", "no param info", "cluster"])
def test_a_compiled_kernel_the_driver_cannot_launch_goes_through_tritons_launcher(drv: _Driver | None) -> None:
    kernel = _triton_kernel(num_ctas=2)
    compiled = CompiledKernel(kernel, 2, drv)  # type: ignore[arg-type]
    compiled(3, 0x99, (0x7F00_0000_2000, 12), ("BLOCK", 1024))
    assert compiled.kept is None and (drv is None or not drv.launches)
    # Triton's launcher: the grid, the stream, the function and its packed metadata,
    # three hooks unset, then every argument, constexprs last.
    assert kernel.runs == [(3, 1, 1, 0x99, 0xBEEF, "packed", None, None, None, 0x7F00_0000_2000, 12, "BLOCK", 1024)]
