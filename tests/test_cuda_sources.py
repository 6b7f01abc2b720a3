"""The CUDA C++ sources compile (CPU CI: nvcc and cmake are present, no GPU needed).

A syntax or template error in kernels/ fails here: the kernel header is compiled to PTX for
compute_90 and SASS for sm_90a with every entry point checked, and the CMake project configures and
builds the torch extension (host and device code). The extension module's eager steps run here
host-only (on CPU tensors they plan and encode without launching), against their numpy twins.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gather_cases import check_gather_case, make_gather_case, random_each_call, record_gather_case
from ptx_checks import waits_before_memory
from vllm_omni_kernels.gather import RowGather
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S
from vllm_omni_kernels.ops import cuda_ext, gather_jobs
from vllm_omni_kernels.ops.each_records import check_each_numpy
from vllm_omni_kernels.ops.gather_jobs import GatherJobs, TableLayout, decode_table
from vllm_omni_kernels.ring import PaddedBatch, RingPool

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
PARAM_WORDS = (128, 256, 512, 1024, 2048, 3072, 4088)  # the sizes of the entries that take their metadata as parameters
ENTRY_POINTS = [f"vok_ring_{op}_e{s}_{k}" for op in ("write", "read") for s in (2, 4, 8) for k in ("dim0", "last")] + \
    [f"vok_row_gather_e{s}_a{a}" for s in (2, 4) for a in (0, 1)] + \
    [f"vok_ring_write_e{s}_{k}_p{n}" for s in (2, 4, 8) for k in ("dim0", "last") for n in PARAM_WORDS] + \
    [f"vok_row_gather_e{s}_a{a}_p{n}" for s in (2, 4) for a in (0, 1) for n in PARAM_WORDS]

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@needs_nvcc
def test_kernel_header_compiles_to_ptx_and_sass_with_every_entry_point(tmp_path):
    src = tmp_path / "all.cu"
    src.write_text(f'#include "{KERNELS / "vok_kernels.cuh"}"\n')
    subprocess.run(["nvcc", "-std=c++17", "-ptx", "-arch=compute_90", str(src), "-o", str(tmp_path / "k.ptx")],
                   check=True, capture_output=True, text=True)
    ptx = (tmp_path / "k.ptx").read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert set(ENTRY_POINTS) <= entries, set(ENTRY_POINTS) - entries
    subprocess.run(["nvcc", "-std=c++17", "-cubin", "-arch=sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                   check=True, capture_output=True, text=True)
    # Launched with programmatic dependent launch, a kernel may start before the one ahead of it
    # ends: every entry waits for it before its first access to memory.
    for name, body in re.findall(r"\.entry\s+(\w+)(.*?)\n}", ptx, re.S):
        assert waits_before_memory(body), f"{name} touches memory before griddepcontrol.wait"


needs_cmake = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cmake") is None
                                 or torch.version.cuda is None, reason="nvcc, cmake or a CUDA torch missing")


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory):
    """Configure and build the extension once for this module: (configure stdout, library path)."""
    build = tmp_path_factory.mktemp("build")
    run = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython3_EXECUTABLE={sys.executable}"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    configure = run.stdout
    run = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return configure, build / "_vok_ops.so"


@needs_cmake
def test_cmake_configures_and_builds_the_torch_extension(cmake_build):
    configure, lib = cmake_build
    assert "arch=compute_90a,code=sm_90a" in configure and "code=compute_90" in configure
    assert lib.is_file()
    # The library is a Python module; importing it registers the ops (no GPU needed).
    code = ("import torch; from vllm_omni_kernels.ops.cuda_ext import import_extension; "
            f"m = import_extension({str(lib)!r}); print(sorted(n for n in dir(m) if not n.startswith('_'))); "
            "print(torch.ops.vllm_omni_kernels.ring_write.default._schema)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("['GatherStep', 'RingStep', 'check_each', 'programmatic_launch', 'set_programmatic_launch']" in out.stdout
            and "Tensor(a!) arena" in out.stdout), out.stdout


@needs_cmake
@pytest.mark.parametrize("env", [None, "0", "1"])
def test_programmatic_launch_is_on_unless_the_environment_or_a_call_turns_it_off(cmake_build, env):
    code = ("from vllm_omni_kernels.ops.cuda_ext import import_extension; "
            f"m = import_extension({str(cmake_build[1])!r}); a = m.programmatic_launch(); "
            "m.set_programmatic_launch(not a); print(a, m.programmatic_launch())")
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_OMNI_KERNELS_PDL"}
    if env is not None:
        environ["VLLM_OMNI_KERNELS_PDL"] = env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == (["False", "True"] if env == "0" else ["True", "False"])


@pytest.fixture(scope="module")
def compiled_module(cmake_build):
    """The extension module (its eager steps run host-only on CPU tensors): the process's own when
    the backend loaded one (a GPU machine with a build: a second one would register the ops twice),
    else this build's."""
    from vllm_omni_kernels.ops import cuda_ext
    cuda_ext.load()
    return cuda_ext._module or cuda_ext.import_extension(cmake_build[1])


def _pool_in_some_state(rng):
    """A CPU pool after a few real steps: varied unread sizes, capacities, tails and head overrides."""
    pool = RingPool("audio", torch.float32, (), "cpu", S.CONCAT_LAST, budget_bytes=1 << 16, initial_frames=32,
                    max_slots=12, growth=True)
    ids = [f"r{i}" for i in range(int(rng.integers(1, 12)))]
    for r in ids:
        pool.alloc(r)
    for _ in range(int(rng.integers(0, 5))):
        sub = [ids[i] for i in rng.permutation(len(ids))[: int(rng.integers(1, len(ids) + 1))]]
        pool.append(sub, PaddedBatch(torch.zeros(len(sub), 48), rng.integers(0, 49, len(sub))))
        if rng.random() < 0.5:
            pool.drain(sub[:1])
    for r in ids[len(ids) // 2:] if rng.random() < 0.3 else []:  # fresh slots: head overrides again
        pool.free(r)
        pool.alloc(r)
    return pool, ids


def _step_of(module, pool):
    return module.RingStep(pool.arena, pool.state, pool._table_t, list(pool.frame_shape), pool.last)


@needs_cmake
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bad=st.sampled_from(["none", "negative", "too_long", "overflow"]),
       as_list=st.booleans())
def test_compiled_ring_step_plans_as_the_numpy_plan(compiled_module, seed, bad, as_list):
    """The compiled append step (host half: checks, planning, staging) and RingPool._plan_numpy agree
    on the staged rows, the advanced slot table and the status, for valid steps and for each way a
    row can fail (then -1 and the table is left as it was), with lengths as numpy or a list."""
    rng = np.random.default_rng(seed)
    pool, ids = _pool_in_some_state(rng)
    sub = [ids[i] for i in rng.permutation(len(ids))[: int(rng.integers(1, len(ids) + 1))]]
    slots = np.array([pool.slot_of(r) for r in sub], np.int64)
    axis_len = 40
    free = pool._cap[slots] - pool._size[slots]
    n = np.minimum(rng.integers(0, axis_len + 1, len(slots)), free)
    b = int(rng.integers(0, len(slots)))
    if bad == "negative":
        n[b] = -1
    elif bad == "too_long":
        n[b] = axis_len + 1
    elif bad == "overflow":
        pool._size[slots[b]] = pool._cap[slots[b]] - 1
        n[b] = 2
    before = pool._table.copy()
    staged_np = np.zeros((len(slots), 8), np.int64)
    got_np = pool._plan_numpy(staged_np, slots, n, axis_len, axis_len, axis_len)
    after_np = pool._table.copy()
    pool._table[:] = before
    step = _step_of(compiled_module, pool)
    data = torch.zeros(len(sub), axis_len)
    lengths = n.tolist() if as_list else n
    assert step(sub, data, lengths, pool.version) == 0  # request list not given yet
    step.set_slots(tuple(sub), slots, pool.version)
    got = step(sub, data, lengths, pool.version)
    assert np.array_equal(pool._table, after_np)
    if bad == "none":
        assert got == len(sub) and got_np == n.max()
        assert step.staged_in_params  # a few rows: the launch's parameters
        assert np.array_equal(step.staged.numpy(), staged_np)
    else:
        assert got == -1 and got_np == -(b + 1)
        assert np.array_equal(pool._table, before)


@needs_cmake
def test_compiled_ring_step_declines_what_is_not_its_step(compiled_module):
    """Anything the general path must see (and report) is declined with -1 and changes nothing; a
    changed request list or pool version asks for the slots again (0)."""
    pool = RingPool("audio", torch.float32, (2,), "cpu", S.CONCAT_DIM0, budget_bytes=1 << 16, initial_frames=16,
                    max_slots=4)
    for r in ("a", "b"):
        pool.alloc(r)
    step = _step_of(compiled_module, pool)
    step.set_slots(("a", "b"), [pool.slot_of("a"), pool.slot_of("b")], pool.version)
    ok = torch.zeros(2, 3, 2)
    before = pool._table.copy()
    for data, lengths in ((ok.double(), [1, 1]), (torch.zeros(2, 3, 3), [1, 1]), (torch.zeros(3, 3, 2), [1, 1]),
                          (torch.zeros(2, 2, 3, 2)[:, 0], [1, 1]), (ok, torch.tensor([1, 1])), (ok, [1]),
                          (ok, np.array([1, 1], np.int32)), (ok, [1, "x"]), (ok, [4, 1])):
        assert step(["a", "b"], data, lengths, pool.version) == -1, (data.shape, lengths)
    assert np.array_equal(pool._table, before)
    assert step(["a", "c"], ok, [1, 1], pool.version) == 0
    assert step(["b", "a"], ok, [1, 1], pool.version) == 0
    assert step(["a", "b"], ok, [1, 1], pool.version + 1) == 0
    assert step(["a", "b"], ok, np.array([2, 3]), pool.version) == 2
    assert pool._size[[pool.slot_of("a"), pool.slot_of("b")]].tolist() == [2, 3]


@needs_cmake
def test_step_call_entries_check_their_arguments(compiled_module):
    """``step.call`` (the plain CPython entry of each step) takes its arguments positionally and
    raises TypeError naming the call for a wrong count, keywords or a wrong type; it keeps the step
    alive."""
    pool = RingPool("audio", torch.float32, (), "cpu", S.CONCAT_LAST, budget_bytes=1 << 12, max_slots=2)
    pool.alloc("a")
    step = _step_of(compiled_module, pool)
    call = step.call
    del step
    ok = (["a"], torch.zeros(1, 4), [1], pool.version)
    assert call(*ok) == 0  # no request list given yet: the step is alive and answers
    for args, kwargs, words in (((["a"], torch.zeros(1, 4)), {}, "takes 4 arguments, got 2"),
                                (ok[:3], {"version": 0}, "positional arguments only"),
                                ((["a"], "data", [1], 0), {}, "data must be a tensor"),
                                ((["a"], torch.zeros(1, 4), [1], "v"), {}, "integer")):
        with pytest.raises(TypeError, match=words):
            call(*args, **kwargs)
    gather = compiled_module.GatherStep(torch.zeros(1), 8, 1, 1, 2).call
    with pytest.raises(TypeError, match="takes 7 arguments"):
        gather([], [], [])
    with pytest.raises(TypeError, match="blocks must be lists"):
        gather((), [], [], 1, 0, 0, True)
    assert gather([], [], [], 0, 0, 0, True) == 0
    for counts in ((2, 0, 0), (0, 2, 0), (1, 1, 3)):  # over a capacity: nothing encoded
        with pytest.raises(ValueError, match="exceed this gather's capacity"):
            gather([], [], [], *counts, True)


@needs_cmake
def test_pool_append_calls_its_bound_compiled_step_until_the_backend_setting_changes(compiled_module, monkeypatch):
    """With a compiled backend, RingPool.append resolves its step once and then calls it directly
    while the backend setting holds: request-list changes (the step asks for the slots), declined
    steps (the general path reports the bad row) and new slots (head overrides cleared) all plan as
    the numpy path does; a changed setting is resolved again."""
    from vllm_omni_kernels import ops

    def factory(*args):
        return compiled_module.RingStep(*args)

    resolved = []

    def ring_step(is_cuda):
        resolved.append(is_cuda)
        return factory

    def make_pool():
        pool = RingPool("audio", torch.float32, (), "cpu", S.CONCAT_LAST, budget_bytes=1 << 16, initial_frames=64,
                        max_slots=6, growth=False)
        for r in "abcd":
            pool.alloc(r)
        return pool

    def run(pool):  # (rows appended, requests with errors, slot table) after each append
        out = []
        for ids, n in steps:
            if n is None:
                pool.free(ids[-1])
                pool.alloc(ids[-1])
                continue
            res = pool.append(list(ids), PaddedBatch(torch.zeros(3, 64), np.array(n)))
            out.append((res.appended, [e.request_id for e in res.errors], pool._table.copy()))
        return out

    steps = [("abc", [3, 0, 5]), ("abc", [1, 2, 3]), ("bcd", [4, 4, 4]), ("bcd", [1, 99, 1]), ("bcd", [2, 2, 2]),
             ("free a", None), ("abd", [1, 1, 1]), ("abd", [2, 0, 2])]
    expected = run(make_pool())  # planned by _plan_numpy (ops.ring_step is None on CPU)
    monkeypatch.setattr(ops, "ring_step", ring_step)
    pool = make_pool()
    got = run(pool)
    for (a, errors_a, table_a), (b, errors_b, table_b) in zip(got, expected):
        assert (a, errors_a) == (b, errors_b)
        assert np.array_equal(table_a, table_b)
    assert got[3][1] == ["c"]  # the declined step's bad row, reported by the general path
    calls = len(resolved)
    assert calls <= 3  # resolved on the first step, and again only where append took the long way
    pool.append(["a", "b", "d"], PaddedBatch(torch.zeros(3, 64), np.array([1, 1, 1])))
    assert len(resolved) == calls  # the bound step was called directly
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", "torch")
    pool.append(["a", "b", "d"], PaddedBatch(torch.zeros(3, 64), np.array([1, 1, 1])))
    assert len(resolved) == calls + 1  # the setting changed: resolved again


@needs_cmake
def test_compiled_ring_step_declines_more_rows_than_one_launch_takes(compiled_module):
    """A step of more rows than a launch's grid holds (65535) is declined before it is planned, so
    the slot table is not advanced for a launch that cannot run."""
    rows = 65536
    table = torch.zeros(rows, 8, dtype=torch.int64)
    table[:, 4] = 1 << 20  # capacity
    step = compiled_module.RingStep(torch.zeros(16), torch.zeros(rows, dtype=torch.int64), table, [], True)
    ids = tuple(f"r{i}" for i in range(rows))
    step.set_slots(ids, list(range(rows)), 0)
    before = table.clone()
    assert step(ids, torch.zeros(rows, 1), np.ones(rows, np.int64), 0) == -1
    assert torch.equal(table, before)
    step.set_slots(ids[:-1], list(range(rows - 1)), 1)
    assert step(ids[:-1], torch.zeros(rows - 1, 1), np.ones(rows - 1, np.int64), 1) == rows - 1
    assert not step.staged_in_params  # too many rows for the parameters: staged in the ring
    staged = step.staged.numpy()
    assert staged.shape == (rows - 1, 8) and np.array_equal(staged[:, 0], np.arange(rows - 1))
    assert np.array_equal(staged[:, 2], np.ones(rows - 1)) and np.array_equal(staged[:, 1], np.arange(rows - 1))


@needs_cmake
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       width=st.sampled_from([1, 8, 33, 256]))
def test_compiled_gather_encoder_writes_the_numpy_encoders_table(compiled_module, seed, dtype, width):
    """The compiled gather launch's encoder (its host half: it encodes only, given a CPU anchor)
    writes the table GatherJobs.encode writes, word for word: float rows, every int pairing,
    single-row jobs and value payloads; with the many-source blocks' records copied from what
    check_each made of them while they were recorded, or made again from the sources (no records,
    or records for another anchor)."""
    dsts, srcs, jobs = make_gather_case(seed, dtype, width)
    gather = RowGather(dtype, width, "cpu", max_float_rows=64, max_int_rows=64, max_values=64)
    with pytest.MonkeyPatch.context() as mp:  # many-source jobs checked by the extension: one block each
        mp.setattr(cuda_ext, "_module", compiled_module)
        record_gather_case(gather.jobs, dsts, srcs, jobs)
    j = gather.jobs
    many = sum(kind.endswith("_each") and sum(n for _, _, n in src) > 0 for kind, _, _, src, _ in jobs)
    assert sum(type(b[0]) is list for b in j.float_blocks + j.int_blocks) == many  # empty calls add none
    assert all(type(b[1]) is bytes for b in j.float_blocks + j.int_blocks if type(b[0]) is list)
    layout = TableLayout(j.n_float, j.n_int, j.n_values)
    args = (j.float_blocks, j.int_blocks, j.value_blocks, j.n_float, j.n_int, j.n_values, j.aligned)
    bare = [[(b[0], None, *b[2:]) if type(b[0]) is list else b for b in blocks]
            for blocks in (j.float_blocks, j.int_blocks)]
    for anchor in (gather._anchor, torch.zeros(1, dtype=dtype)):  # the records' anchor, another one
        step = compiled_module.GatherStep(anchor, width, 64, 64, 64)
        assert step(*args) == 1
        assert step.in_params  # a small table travels in the parameters
        numpy_table = np.full(layout.words, -7, np.int64)
        words = j.encode(numpy_table, layout, anchor.data_ptr(), anchor.data_ptr())
        assert len(decode_table(numpy_table, layout.int_off)[1]) < j.n_int  # int runs merged
        assert step.table.numel() == words < layout.words
        assert np.array_equal(step.table.numpy(), numpy_table[:words])
        for blocks in (args[:2], bare):  # the per-step entry; without records
            step.table.fill_(-7)  # on CPU the step reuses its one buffer: words it does not write stay -7
            assert step.call(*blocks, *args[2:]) == 1
            assert np.array_equal(step.table.numpy(), numpy_table[:words])


@needs_cmake
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       width=st.sampled_from([1, 8, 33]), shift=st.sampled_from([0, 1, 4, 8, 4096]))
def test_numpy_encoder_uses_the_records_check_each_made_for_any_bases(compiled_module, seed, dtype, width, shift):
    """The numpy encoder (Triton and CuPy launches, and every ``prepare_static``) writes a
    many-source block from the records check_each made while it was recorded: as they are for the
    anchor they were made for, shifted for another float or int base (an int table's own address),
    and made again from the sources when the bases are not a whole unit apart. Every table equals the
    one encoded from the sources alone."""
    dsts, srcs, jobs = make_gather_case(seed, dtype, width)
    gather = RowGather(dtype, width, "cpu", max_float_rows=64, max_int_rows=64, max_values=64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_ext, "_module", compiled_module)
        record_gather_case(gather.jobs, dsts, srcs, jobs)
    j = gather.jobs
    layout = TableLayout(j.n_float, j.n_int, j.n_values)
    noted = (j.float_blocks, j.int_blocks)
    bare = [[(b[0], None, *b[2:]) if type(b[0]) is list else b for b in blocks] for blocks in noted]
    made_for = gather._anchor.data_ptr()
    other = torch.zeros(16, dtype=torch.int64).data_ptr()
    for float_base, int_base in ((made_for, made_for), (made_for, other), (made_for + shift, other + shift),
                                 (made_for - 3 * shift, made_for + shift)):
        tables = []
        for j.float_blocks, j.int_blocks in (noted, bare):
            table = np.full(layout.words, -7, np.int64)
            tables.append(table[:j.encode(table, layout, float_base, int_base)])
        assert np.array_equal(tables[0], tables[1]), (float_base - made_for, int_base - made_for)


@needs_cmake
@pytest.mark.parametrize("width, dtype, counts", [(8, torch.float32, [128, 128, 44, 128, 72, 1, 1, 3]),
                                                  (4096, torch.bfloat16, [256, 44, 200, 1, 1, 3])])
def test_both_encoders_write_a_run_of_int_rows_as_records_of_one_pass(compiled_module, width, dtype, counts):
    """300 one-element ids at consecutive offsets, 40 rows of 5 codes and two one-row jobs: the runs
    as records of ``int_run_cap`` elements (128 or 256 here: what an int job's blocks copy in one
    pass), the single rows and the value job as records of their own, in both encoders."""
    j = GatherJobs(dtype, width, "cpu")
    ids, out = torch.arange(300), torch.zeros(400, dtype=torch.int32)
    codes, code_out = torch.zeros(40, 5, dtype=torch.int32), torch.zeros(40, 5, dtype=torch.int64)
    j.ints(out, np.arange(50, 350), ids)
    j.ints(code_out, np.arange(40), codes)
    j.ints(out, 360, ids, 0)
    j.ints(out, 361, ids, 1)
    j.values(torch.zeros(3, dtype=torch.int32), np.arange(3, dtype=np.int32))
    layout = TableLayout(j.n_float, j.n_int, j.n_values)
    anchor = torch.zeros(1, dtype=dtype)
    step = compiled_module.GatherStep(anchor, width, 0, 400, 8)
    assert step.call(j.float_blocks, j.int_blocks, j.value_blocks, j.n_float, j.n_int, j.n_values, j.aligned) == 1
    numpy_table = np.zeros(layout.words, np.int64)
    words = j.encode(numpy_table, layout, anchor.data_ptr(), anchor.data_ptr())
    assert np.array_equal(step.table.numpy(), numpy_table[:words])
    assert decode_table(numpy_table, layout.int_off)[1][:, 2].tolist() == counts


@needs_cmake
def test_compiled_gather_tables_past_the_parameter_size_are_staged_with_ints_from_the_anchor(compiled_module):
    """A table of more words than a launch's parameters take (kernels/vok_launch.h: 4088) goes to
    the pinned ring, its int words offsets from the anchor as in the parameters; the encoders agree
    there too."""
    rows = 2100  # 2 + 2 * 2100 float words alone
    gather = RowGather(torch.float32, 4, "cpu", max_float_rows=rows, max_int_rows=2, max_values=8)
    src, dst = torch.randn(rows, 4), torch.zeros(rows, 4)
    ids, out = torch.arange(6, dtype=torch.int64).view(1, 6), torch.zeros(1, 6, dtype=torch.int32)
    j = gather.jobs
    j.rows(dst, np.arange(rows)[::-1].copy(), src)
    j.ints(out, np.arange(1), ids)  # one int job of 6 elements
    j.values(torch.zeros(5, dtype=torch.int32), np.arange(5, dtype=np.int32))
    layout = TableLayout(j.n_float, j.n_int, j.n_values)
    assert layout.words > 4088
    anchor = torch.zeros(1)
    step = compiled_module.GatherStep(anchor, 4, rows, 2, 8)
    assert step.call(j.float_blocks, j.int_blocks, j.value_blocks, j.n_float, j.n_int, j.n_values, j.aligned) == 1
    table = step.table
    assert not step.in_params
    numpy_table = np.zeros(layout.words, np.int64)
    words = j.encode(numpy_table, layout, anchor.data_ptr(), anchor.data_ptr())
    assert words == layout.words and np.array_equal(table.numpy(), numpy_table)
    assert decode_table(numpy_table, layout.int_off)[1][1, 3] == 4  # the value job (int job 1) reads the payload


@needs_cmake
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       width=st.sampled_from([1, 8, 33]))
def test_many_source_blocks_copy_as_their_sources_one_by_one(compiled_module, seed, dtype, width):
    """``rows_each``/``ints_each`` checked by the extension (one block of many sources) copy exactly
    what the same calls recorded source by source copy, on the reference and on the Triton kernels
    (under the interpreter), against the reference of the source-by-source recording."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gather_jobs, "_check_each", lambda *args: None)  # recorded source by source
        want = check_gather_case(seed, dtype, width, "cpu", "torch", mp)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_ext, "_module", compiled_module)
        for backend in ("torch", "triton"):
            got = check_gather_case(seed, dtype, width, "cpu", backend, mp)
            assert all(torch.equal(got[k], want[k]) for k in want), backend


@needs_cmake
@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), floating=st.booleans(), base=st.sampled_from(["anchor", "zero", "odd"]))
def test_numpy_check_each_returns_what_the_compiled_one_returns(compiled_module, seed, floating, base):
    """The numpy twin of the extension's ``check_each`` (installs without the build) gives the
    same result on the same call: the rows, the alignment, the notes' bytes (records for offsets
    from ``base``), or the same declined source."""
    srcs, starts, dst = random_each_call(seed, floating)
    base = {"anchor": torch.zeros(1).data_ptr(), "zero": 0, "odd": dst.data_ptr() + 4}[base]
    assert check_each_numpy(srcs, starts, dst, floating, base) == \
        tuple(compiled_module.check_each(srcs, starts, dst, floating, base))


@needs_cmake
@pytest.mark.parametrize("with_extension", [False, True])
def test_many_source_records_name_the_bad_source_and_record_nothing(compiled_module, with_extension, monkeypatch):
    """A bad source among many (dtype, device, width, out-of-range start) raises the typed error of
    ``rows``/``ints`` naming ``srcs[k]`` with ``index`` k; nothing of the call is recorded."""
    if with_extension:
        monkeypatch.setattr(cuda_ext, "_module", compiled_module)
    gather = RowGather(torch.float32, 4, "cpu", max_float_rows=64, max_int_rows=64)
    jobs = gather.jobs
    dst, ids = torch.zeros(10, 4), torch.zeros(10, dtype=torch.int32)
    good = [torch.ones(1, 4), torch.ones(2, 4)]
    jobs.rows_each(dst, [0, 2], good)
    before = (len(jobs.float_blocks), jobs.n_float, len(jobs.int_blocks), jobs.n_int)
    for bad, error in ((torch.ones(1, 4, dtype=torch.float64).to(torch.int32), TypeError),
                       (torch.ones(1, 5), ValueError), ("not a tensor", TypeError)):
        with pytest.raises(error, match=r"srcs\[1\]") as err:
            jobs.rows_each(dst, [5, 7], [good[0], bad])
        assert err.value.index == 1
    with pytest.raises(IndexError, match=r"srcs\[1\]"):
        jobs.rows_each(dst, [5, 9], good)  # rows 9..10 of 10
    with pytest.raises(TypeError, match=r"srcs\[0\]"):
        jobs.ints_each(ids, [0], [torch.zeros(1)])
    assert (len(jobs.float_blocks), jobs.n_float, len(jobs.int_blocks), jobs.n_int) == before
