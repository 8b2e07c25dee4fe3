"""Errors the converter raises (defined with the package's other errors in ``nvfp4_megamoe.errors``).

Each message names the file or tensor and says what was expected. The CLI turns any of them into a
one-paragraph message and a non-zero exit.
"""

from __future__ import annotations

from nvfp4_megamoe.errors import ConvertError, OutputError, PlanError, SourceError, shown

__all__ = ["ConvertError", "OutputError", "PlanError", "SourceError", "shown"]
