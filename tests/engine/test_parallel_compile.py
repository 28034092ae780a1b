"""hkv/engine/parallel_compile.py: an autotuner's benchmark compiles all its configs on a thread pool
first, then times each config as before (the winner is still the fastest), and a result the autotuner
already holds compiles nothing. Triton's real Autotuner, a fake kernel that records its calls."""

import threading
import time

import pytest

from hkv.engine import parallel_compile

# Triton is imported inside the tests, not here: a module-level import while pytest collects this folder
# would define triton.language's own @jit helpers before tests/kernels/conftest.py sets TRITON_INTERPRET,
# and every interpreted kernel test after it would fail ("Cannot call @triton.jit'd outside ...").


def _kernel_body(x, n, BLOCK):  # the autotuner walks .fn down to a plain function
    pass


class FakeKernel:
    """Stands for a JITFunction: `run(..., warmup=True)` compiles (slowly), `warmup=False` launches."""

    fn = staticmethod(_kernel_body)

    def __init__(self, compile_s: float = 0.05, fail_block: int | None = None):
        self.compile_s = compile_s
        self.fail_block = fail_block
        self.compiled: set[int] = set()
        self.compile_threads: set[str] = set()
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def _compile(self, block: int) -> None:
        if block == self.fail_block:
            raise RuntimeError("out of resources")
        if block not in self.compiled:
            time.sleep(self.compile_s)
            with self.lock:
                self.compiled.add(block)

    def run(self, *args, grid=None, warmup=False, BLOCK=None, **kwargs):
        with self.lock:
            self.events.append(("compile" if warmup else "launch", BLOCK))
            if warmup:
                self.compile_threads.add(threading.current_thread().name)
        self._compile(BLOCK)
        return None


def _tuner(kernel: FakeKernel, blocks=(16, 32, 64, 128), fastest: int = 64):
    from triton import Config
    from triton.runtime.autotuner import Autotuner

    def bench(kernel_call, quantiles):  # "times" the launch: the config whose BLOCK is `fastest` wins
        kernel_call()
        block = kernel.events[-1][1]
        t = 1.0 if block == fastest else 2.0 + block / 1000
        return [t, t, t]

    return Autotuner(kernel, ["x", "n"], [Config({"BLOCK": b}) for b in blocks], ["n"], None, None, do_bench=bench)


@pytest.fixture
def installed():
    parallel_compile.install(workers=4)
    yield
    parallel_compile.uninstall()


def test_the_benchmark_compiles_every_config_in_parallel_first(installed):
    kernel = FakeKernel(compile_s=0.2)
    tuner = _tuner(kernel)
    started = time.perf_counter()
    tuner.run("x", 1000, grid=(1,), warmup=False)
    took = time.perf_counter() - started
    # four 0.2 s compiles on four threads: about 0.2 s, not the 0.8 s of compiling each as it is timed
    assert took < 0.6, took
    kinds = [kind for kind, _ in kernel.events]
    assert kinds[:4] == ["compile"] * 4 and set(kinds[4:]) == {"launch"}
    assert {b for kind, b in kernel.events if kind == "compile"} == {16, 32, 64, 128}
    assert all(name.startswith("hkv-compile") for name in kernel.compile_threads)
    assert tuner.cache[(1000,)].kwargs == {"BLOCK": 64}  # the benchmark's choice, as without the pool
    assert kernel.events[-1] == ("launch", 64)


def test_a_known_key_compiles_nothing_more(installed):
    kernel = FakeKernel(compile_s=0.0)
    tuner = _tuner(kernel)
    tuner.run("x", 1000, grid=(1,), warmup=False)
    kernel.events.clear()
    tuner.run("x", 1000, grid=(1,), warmup=False)
    assert kernel.events == [("launch", 64)]
    tuner.run("x", 2000, grid=(1,), warmup=False)  # a new key: benchmarked again, precompiled again
    assert [kind for kind, _ in kernel.events].count("compile") == 4


def test_a_config_that_fails_to_compile_is_left_to_the_benchmark(installed):
    """The pool swallows the failure; the benchmark meets it and raises as Triton's autotuner would
    for an error it does not absorb (a real OutOfResources there is timed as infinite)."""
    kernel = FakeKernel(compile_s=0.0, fail_block=128)
    tuner = _tuner(kernel, blocks=(16, 128))
    with pytest.raises(RuntimeError, match="out of resources"):
        tuner.run("x", 1000, grid=(1,), warmup=False)
    assert ("compile", 16) in kernel.events and kernel.compiled == {16}


def test_uninstall_restores_triton_and_install_is_idempotent():
    from triton.runtime.autotuner import Autotuner

    original = Autotuner._bench
    parallel_compile.install(workers=2)
    wrapped = Autotuner._bench
    parallel_compile.install(workers=8)
    assert Autotuner._bench is wrapped and wrapped is not original
    parallel_compile.uninstall()
    assert Autotuner._bench is original
    kernel = FakeKernel(compile_s=0.0)
    _tuner(kernel).run("x", 1000, grid=(1,), warmup=False)
    assert "compile" not in [kind for kind, _ in kernel.events]


def test_default_workers_is_bounded():
    assert 1 <= parallel_compile.default_workers() <= 16
