"""Ray 2.60 against vLLM 0.32 (the CPU build): one import that moved.

Ray Serve LLM's KV-aware router tokenizes in its LLMRouter with
`from vllm.entrypoints.chat_utils import load_chat_template`
(ray/llm/_internal/serve/routing_policies/kv_aware/vllm/tokenizer.py:5). vLLM 0.32 has that
function in `vllm.renderers.chat_utils`, so every LLMRouter replica fails to start with
`ModuleNotFoundError: No module named 'vllm.entrypoints.chat_utils'` and Ray's router never
runs. `raykv bench vllm-serve` puts this directory on PYTHONPATH of its own Ray cluster only:
Python runs this file at start-up, and the finder below answers that one module name with
vLLM's own module, only when vLLM has no module of that name (it is last on sys.meta_path).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {"vllm.entrypoints.chat_utils": "vllm.renderers.chat_utils"}


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, _MovedModuleLoader(MOVED[name]))


sys.meta_path.append(_MovedModuleFinder())
