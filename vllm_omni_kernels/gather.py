"""``RowGather``: one fused launch of row copies per call, with its metadata in a persistent buffer.

The launcher owns a ``GatherJobs`` (what to copy), a ring of pinned host tables and a device table.
``launch()`` is the eager step: validate, encode on the host, one kernel, nothing else on the device,
nothing allocated. The compiled backend passes the table in the launch's parameters (up to 4088
words; ``kernels/vok_python.cpp``); the other backends encode into the next pinned table and the
kernel reads it in place over the bus (pinned memory is device-addressable): no copy. For CUDA
graphs, ``prepare_static()`` uploads the table into the resident device table (before each replay)
and ``run_static(grid_rows)`` is the one kernel to capture.
"""

from __future__ import annotations

import torch

from . import ops
from .ops.gather_jobs import GatherJobs, TableLayout
from .staging import PinnedStaging


class RowGather:
    """Fused row copies into runner buffers; see the module docstring.

    Args:
        dtype, width: float rows' dtype and element count.
        device: where every tensor of the launch lives.
        max_float_rows, max_int_rows, max_values: per-launch capacities (float rows, int rows plus
            value blocks, int32 values); exceeding them raises ``ValueError`` before anything runs.
        check_rows: validate row ranges and disjointness (see ``GatherJobs``).
    """

    def __init__(self, dtype: torch.dtype, width: int, device: torch.device | str, *, max_float_rows: int,
                 max_int_rows: int, max_values: int = 0, check_rows: bool = True):
        self.device = torch.device(device)
        self.jobs = GatherJobs(dtype, int(width), self.device, check_rows=check_rows)
        self.capacity = TableLayout(int(max_float_rows), int(max_int_rows), int(max_values))
        self.table = torch.zeros(self.capacity.words, dtype=torch.int64, device=self.device)
        self._anchor = torch.zeros(1, dtype=dtype, device=self.device)
        self.jobs.record_base = self._anchor.data_ptr()  # the compiled launch's base: see GatherJobs
        self._staging = PinnedStaging(1, self.capacity.words, self.device)
        self._resident = self.table
        self._static_aligned: bool | None = None  # the alignment promise baked into a captured kernel
        self._table_rows = self.table.view(1, -1)
        self.launches = 0
        self._layouts: dict[tuple[int, int, int], TableLayout] = {}
        # (ops.setting() when resolved, ops.gather_step's factory or None, its compiled step's call or None)
        self._step: tuple = (object(), None, None)

    def _validate(self) -> None:
        jobs = self.jobs
        if (jobs.n_float > self.capacity.float_cap or jobs.n_int > self.capacity.int_cap
                or jobs.n_values > self.capacity.payload_cap):
            raise ValueError(f"{jobs.n_float} float rows / {jobs.n_int} int jobs / {jobs.n_values} values exceed "
                             f"this gather's capacity {self.capacity}")
        jobs.check_disjoint()

    def _encode(self, layout: TableLayout, resident: bool) -> tuple[torch.Tensor | None, int]:
        """Validate and encode the jobs into the next pinned table; with ``resident`` also upload it
        into the device table. Returns the table the kernel reads (None: the reference backend) and
        its job count (a run of int rows takes fewer records than rows: ``gather_jobs``)."""
        jobs = self.jobs
        self._validate()
        if not ops.uses_kernel(jobs.is_cuda):
            return None, jobs.n_float + jobs.n_int
        i, host = self._staging.host()
        upload = resident and self._staging.pinned
        # The kernel reads the device table after an upload, else the host buffer in place (pinned on
        # CUDA; on CPU, under the Triton interpreter, that buffer is the table).
        target = self.table if upload else self._staging.read_in_place(i, row0=True)
        words = jobs.encode(host[0], layout, self._anchor.data_ptr(), target.data_ptr())
        if upload:
            self._staging.upload(i, 1, self._table_rows, cols=words)
        if resident:
            self._resident = target
        return target, int(host[0][0] + host[0][1])

    def launch(self) -> int:
        """Run and clear the recorded jobs: one kernel reading its table in place (0 launches when
        empty)."""
        jobs = self.jobs
        if jobs.n_float + jobs.n_int == 0:
            return 0
        step = self._step
        if step[0] is not ops.setting():  # resolved again only when the backend setting changed
            step = self._step = self._resolve_step()
        if step[2] is not None:  # the compiled backend checks capacity, encodes and launches in one call
            if jobs.check_rows:
                jobs.check_disjoint()
            step[2](jobs.float_blocks, jobs.int_blocks, jobs.value_blocks, jobs.n_float, jobs.n_int, jobs.n_values,
                    jobs.aligned)
        else:
            key = (jobs.n_float, jobs.n_int, jobs.n_values)
            layout = self._layouts.get(key)
            if layout is None:  # compact: only what is used (few distinct step shapes: cached)
                if len(self._layouts) > 1024:
                    self._layouts.clear()
                layout = self._layouts[key] = TableLayout(*key)
            table, count = self._encode(layout, resident=False)
            ops.row_gather(jobs, table, self._anchor, layout=layout, grid_rows=count)
        jobs.clear()
        self.launches += 1
        return 1

    def _resolve_step(self) -> tuple:
        """(the backend setting, ops.gather_step's factory, the ``call`` of the compiled step bound to
        this gather, kept while the factory is the same) or (setting, None, None) without one."""
        make_step = ops.gather_step(self.jobs.is_cuda)
        old = self._step
        if make_step is None:
            return ops.setting(), None, None
        call = old[2] if old[1] is make_step else make_step(self._anchor, self.jobs.width, self.capacity).call
        return ops.setting(), make_step, call

    def prepare_static(self) -> None:
        """Encode the recorded jobs at the fixed capacity layout and upload them (before a replay).

        Raises ``ValueError`` if a kernel was captured for 16-byte aligned rows and these are not.
        """
        if self._static_aligned and not self.jobs.aligned:
            raise ValueError("the captured gather assumes 16-byte aligned rows; these jobs are not aligned")
        self._encode(self.capacity, resident=True)

    def run_static(self, grid_rows: int) -> None:
        """The one kernel of a captured step: reads the resident table; ``grid_rows`` >= its jobs."""
        if self._static_aligned is None:
            self._static_aligned = self.jobs.aligned
        ops.row_gather(self.jobs, self._resident, self._anchor, layout=self.capacity, grid_rows=grid_rows,
                       aligned=self._static_aligned)
        self.launches += 1
