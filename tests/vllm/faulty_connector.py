"""DWDPConnector with faults planted on demand, for the vLLM stage (tests/vllm/check_hostile.py): while a
file of the fault's name exists in `kv_connector_extra_config["fault_dir"]`,
- <method> (an entry point): that method raises RuntimeError before it does anything. Each planted
  method keeps the production method's guard and fallback (`never_raises`), so what is tested is what
  runs in production: vLLM keeps serving and the request concerned is recomputed;
- truncate_on_open: the worker cuts an artifact to its first 100 bytes right after opening it (after the
  scheduler checked it, before any layer is read).

ENTRY_POINTS: every KVConnectorBase_V1 method DWDPConnector overrides; each must carry the guard (a
method without it fails this module's import, and so the stage)."""
from __future__ import annotations

import os

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from dwdp.integrations.vllm_connector import DWDPConnector, never_raises

ENTRY_POINTS = sorted(name for name, value in vars(DWDPConnector).items()
                      if callable(value) and not name.startswith("_") and hasattr(KVConnectorBase_V1, name))


class FaultyDWDPConnector(DWDPConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._fault_dir = (self._kv_transfer_config.kv_connector_extra_config or {}).get("fault_dir", "")
        open_artifact = self._transfer.open

        def open_then_truncate(ref):
            reader = open_artifact(ref)
            if self._planted("truncate_on_open"):
                os.truncate(os.path.join(self._transfer.directory.path, ref.name), 100)
            return reader

        self._transfer.open = open_then_truncate

    def _planted(self, fault: str) -> bool:
        return bool(self._fault_dir) and os.path.exists(os.path.join(self._fault_dir, fault))


def _plant(name: str) -> None:
    production = getattr(DWDPConnector, name)
    unguarded, fallback = production.__wrapped__, production.fallback

    def planted(self, *args, **kwargs):
        if self._planted(name):
            raise RuntimeError(f"planted in {name}")
        return unguarded(self, *args, **kwargs)

    planted.__name__ = name
    setattr(FaultyDWDPConnector, name, never_raises(fallback)(planted))


for _name in ENTRY_POINTS:
    _plant(_name)
