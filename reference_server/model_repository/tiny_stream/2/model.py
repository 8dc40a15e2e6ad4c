"""The Python-backend entry point of this model: the code is shared by every model of the
repository and lives in ``reference_models.py`` at its top level."""

import os
import sys

# No __pycache__ beside the shared file: Triton would take that folder for a model.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from reference_models import TritonPythonModel  # noqa: E402 (after the path is set)

__all__ = ["TritonPythonModel"]
