"""The local stack (``inferwatch up``): every component on one machine, on loopback ports."""

from inferwatch.stack.core import (
    Stack,
    StackConfig,
    StackError,
    StackInfo,
    default_state_dir,
    free_ports,
    running_stack,
)

__all__ = [
    "Stack",
    "StackConfig",
    "StackError",
    "StackInfo",
    "default_state_dir",
    "free_ports",
    "running_stack",
]
