"""Which model and version names may become label values: the bound on the ``model`` label.

A name is admitted (keeps its own label from then on) when the upstream's repository index
lists it, when the fleet spec or ``--sla`` names it, or when the upstream answered a request
for it with success (``prove``), which covers the moments before the index has been read or
re-read (a pod's first requests, a model loaded a second ago). Up to ``max_models`` names;
anything else is ``contract.MODEL_OVERFLOW``. A name once admitted is never evicted, so its
series stay continuous. An upstream with no index (not a KServe server) gets names admitted
first come up to the cap.

``Telemetry`` owns one catalog and asks it only when a (model, version) pair is new to its
series cache, so nothing here runs per request for names already resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from inferwatch import contract

# Versions admitted per model when the upstream does not list versions (or lists them late).
MAX_UNLISTED_VERSIONS = 8


class ModelCatalog:
    def __init__(self, max_models: int, configured: Iterable[str], on_admit: Callable[[str], None]) -> None:
        self.max_models = max_models
        self.on_admit = on_admit  # a name got its own label (Telemetry sets its SLA gauge)
        self.on_unknown: Callable[[], None] | None = None  # a miss: the refresher re-reads the index
        # name -> versions admitted beyond the index's listing (or all, for unlisted models)
        self._admitted: dict[str, set[str]] = {}
        # the upstream's index: name -> listed versions (empty: none listed)
        self._served: dict[str, set[str]] = {}
        self._open = False  # the upstream cannot list models: admit first come up to the cap
        self.index_read = False  # the upstream's index (or its absence) is known
        for name in configured:
            if len(self._admitted) < self.max_models:
                self._admitted[name] = set()

    def update(self, served: Mapping[str, Iterable[str]] | None, supported: bool = True) -> None:
        """Record what the upstream serves (name -> versions), from its repository index;
        ``served=None, supported=False``: the upstream has no index."""
        self.index_read = True
        if served is None:
            self._open = not supported
            return
        self._open = False
        self._served = {name: {str(v) for v in versions if v} for name, versions in served.items()}
        for name in self._served:
            self._admit(name)

    def _admit(self, name: str) -> bool:
        if name in self._admitted:
            return True
        if len(self._admitted) >= self.max_models:
            return False
        self._admitted[name] = set()
        self.on_admit(name)
        return True

    def prove(self, model: str, version: str) -> bool:
        """The upstream answered a request for ``model``/``version`` with success, so both
        exist: admit them within the caps. True when both now have their own labels."""
        if not model or not self._admit(model):
            return False
        if not version:
            return True
        seen = self._admitted[model]
        if version in seen or version in self._served.get(model, ()):
            return True
        if len(seen) < MAX_UNLISTED_VERSIONS:
            seen.add(version)
            return True
        return False

    def model_label(self, name: str) -> str:
        if not name:
            return contract.MODEL_NONE
        if name in self._admitted:
            return name
        if (self._open or name in self._served) and self._admit(name):
            return name
        if self.on_unknown is not None:
            self.on_unknown()
        return contract.MODEL_OVERFLOW

    def version_label(self, model_label: str, version: str) -> str:
        if not version:
            return ""
        if model_label == contract.MODEL_OVERFLOW or model_label == contract.MODEL_NONE:
            return contract.MODEL_OVERFLOW
        seen = self._admitted[model_label]
        if version in seen:
            return version
        listed = self._served.get(model_label)
        if listed:
            return version if version in listed else contract.MODEL_OVERFLOW
        if len(seen) < MAX_UNLISTED_VERSIONS:
            seen.add(version)
            return version
        return contract.MODEL_OVERFLOW
