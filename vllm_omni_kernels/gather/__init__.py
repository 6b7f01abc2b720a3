"""The fused decode gather: the jobs of a launch and their table (jobs.py), the launcher
(launcher.py: ``RowGather``) and the runner's two launches per step (decode.py: ``DecodeGather``)."""

from .decode import DecodeGather
from .jobs import GatherJobs, TableLayout
from .launcher import RowGather

__all__ = ["DecodeGather", "GatherJobs", "RowGather", "TableLayout"]
