"""Counts the Triton kernel variants this process builds (compiled, or loaded from Triton's disk
cache: either stalls the launch that needs it), through Triton's JIT cache hook. A node warms its
kernels up at start (`kernels.startup`), then `serving()` marks the rest of its life: a variant
built after that is a step stalled mid-serving, logged with the kernel and its arguments'
types, and counted for the metrics (`megainfer:kernel_compiles_while_serving`)."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kernels")


class CompileWatch:
    def __init__(self) -> None:
        self.built = 0  # variants built in this process
        self.built_while_serving = 0
        self.last_while_serving = ""  # the last such variant, as Triton names it
        self.is_serving = False
        self.installed = False
        self._lock = threading.Lock()
        self._previous = None

    def install(self) -> bool:
        """Hooks Triton's JIT (once); False where this Triton has no cache hook (older than 3.4)."""
        with self._lock:
            if self.installed:
                return True
            try:
                from triton import knobs
            except ImportError:
                return False
            if not hasattr(knobs.runtime, "jit_cache_hook"):
                return False
            self._previous = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook
            self.installed = True
            return True

    def serving(self) -> None:
        """From now on a new variant is a stall while serving."""
        self.is_serving = True

    def warming_up(self) -> None:
        """Another warm-up in this process (a second engine): its builds are expected."""
        self.is_serving = False

    def _hook(self, *, repr: str = "", **kwargs) -> bool:
        self.built += 1
        if self.is_serving:
            self.built_while_serving += 1
            self.last_while_serving = repr
            log.warning("kernels: %s built while serving (a step waited for it); the start-up warm-up "
                        "(kernels.startup) missed this variant", repr)
        if self._previous is not None:
            return self._previous(repr=repr, **kwargs)
        return False


WATCH = CompileWatch()
