"""The process's single I/O thread and the sync-to-async bridge."""

from .loop import LoopThread, get_loop_thread

__all__ = ["LoopThread", "get_loop_thread"]
