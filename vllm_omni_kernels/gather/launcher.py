"""``RowGather``: one fused launch of row copies per call, its table encoded by the one planner
(``GatherJobs.encode``).

``launch()`` is the eager step: validate, encode into the next of a ring of pinned host tables, one
kernel that reads the table in place over the bus (pinned memory is device-addressable): no copy,
nothing allocated, no host sync. For CUDA graphs, ``prepare_static()`` encodes into the resident
device table (before each replay) and ``run_static(grid_rows)`` is the one kernel to capture.
"""

from __future__ import annotations

import torch

from .. import ops
from ..ring.staging import MIN_DEPTH, PinnedStaging
from .jobs import GatherJobs, TableLayout


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
        self.capacity = TableLayout(int(max_float_rows) + int(max_int_rows), int(max_values))
        self._max_float, self._max_int = int(max_float_rows), int(max_int_rows)
        self.table = torch.zeros(self.capacity.words, dtype=torch.int64, device=self.device)
        self.anchor = torch.zeros(8, dtype=dtype, device=self.device)  # every offset counts from its address
        # a table per step, read in place: the least depth the staging ring allows (7 words a record)
        self._staging = PinnedStaging(1, self.capacity.words, self.device, depth=MIN_DEPTH)
        self._static_aligned: bool | None = None  # the alignment promise baked into a captured kernel
        self._static_records = 0  # records of the last prepared table
        self._resident = self.table
        self.launches = 0

    def _encode(self, resident: bool) -> tuple[torch.Tensor | None, int]:
        """Validate and encode the jobs: into the next pinned table (read in place), or with
        ``resident`` into the device table (through the pinned one). Returns the table the kernel
        reads (None for the reference backend, which reads the jobs) and the record count (the
        recorded rows for the reference)."""
        jobs = self.jobs
        if jobs.n_float > self._max_float or jobs.n_int > self._max_int or jobs.n_values > self.capacity.values:
            raise ValueError(f"{jobs.n_float} float rows / {jobs.n_int} int jobs / {jobs.n_values} values exceed "
                             f"this gather's capacity ({self._max_float} / {self._max_int} / {self.capacity.values})")
        jobs.check_disjoint()
        if not ops.uses_kernel(jobs.is_cuda):
            return None, jobs.n_float + jobs.n_int
        i, host = self._staging.host()
        upload = resident and self._staging.pinned
        target = self.table if upload else self._staging.read_in_place(i, row0=True)
        count = jobs.encode(host[0], self.capacity, self.anchor.data_ptr(), target.data_ptr())
        if upload:
            self._staging.upload(i, 1, self.table.view(1, -1))
        if resident:
            self._resident = target  # on a CPU device the host table is the resident one
        return target, count

    def launch(self) -> int:
        """Run and clear the recorded jobs: one kernel (0 launches when there are none). A launch
        refused (``ValueError``: over capacity, two jobs on one row) runs nothing and clears them too."""
        jobs = self.jobs
        if jobs.n_float + jobs.n_int == 0:
            return 0
        try:
            table, count = self._encode(resident=False)
        except ValueError:  # refused: nothing ran, and the next step starts from no jobs
            jobs.clear()
            raise
        ops.row_gather(jobs, table, self.anchor, grid_rows=count)
        jobs.clear()
        self.launches += 1
        return 1

    def prepare_static(self) -> int:
        """Encode the recorded jobs into the resident device table (before a replay); returns its
        records, the least ``grid_rows`` of a captured kernel that carries all of them out (a
        caller that captured one per batch size replays one of at least that many).

        Raises ``ValueError`` if a kernel was captured for 16-byte aligned rows and these are not.
        """
        if self._static_aligned and not self.jobs.aligned:
            raise ValueError("the captured gather assumes 16-byte aligned rows; these jobs are not aligned")
        _, self._static_records = self._encode(resident=True)
        return self._static_records

    def run_static(self, grid_rows: int) -> None:
        """The one kernel of a captured step: reads the resident table; ``grid_rows`` >= the records
        of every table prepared for it (``ValueError`` for fewer than the one prepared now)."""
        if grid_rows < self._static_records:
            raise ValueError(f"a grid of {grid_rows} rows for {self._static_records} records")
        if self._static_aligned is None:
            self._static_aligned = self.jobs.aligned
        ops.row_gather(self.jobs, self._resident, self.anchor, grid_rows=grid_rows, aligned=self._static_aligned)
        self.launches += 1
