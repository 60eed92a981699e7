"""Hooks of the vllm-serve phase measurement (vllm_serve_phases/run.py): every Python process
of the run loads this (it is first on PYTHONPATH) and, when RAYKV_PHASES_DIR is set, appends
JSON lines of timings to $RAYKV_PHASES_DIR/<pid>.jsonl: vLLM's scheduler (requests added,
first scheduled, finished; steps), RaykvConnector (asks, lookups, loads, saves, puts), raykv's
router (decision, keying, directory lookup) and Ray's driver-side error listener (polls). It
also runs the benchmark's vllm_compat/sitecustomize.py (RAYKV_PHASES_COMPAT).
RAYKV_PHASES_SAVES (run.py's --saves) "delay" holds each save's put back SAVE_DELAY_S in the
connector's saver thread, "nice" puts from a thread at nice 10: experiments on what a save
costs the replies that travel while it runs."""
import functools
import importlib.abc
import importlib.machinery
import json
import os
import runpy
import sys
import threading
import time

_COMPAT = os.environ.get("RAYKV_PHASES_COMPAT")
_SAVES = os.environ.get("RAYKV_PHASES_SAVES", "now")
SAVE_DELAY_S = 0.05
if _COMPAT:
    runpy.run_path(_COMPAT)

_DIR = os.environ.get("RAYKV_PHASES_DIR")
_fd = None
_lock = threading.Lock()


def log(kind, **fields):
    global _fd
    if not _DIR:
        return
    fields["k"] = kind
    fields.setdefault("t", time.time())
    line = (json.dumps(fields) + "\n").encode()
    with _lock:
        if _fd is None:
            _fd = os.open(os.path.join(_DIR, f"{os.getpid()}.jsonl"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(_fd, (json.dumps({"k": "proc", "t": time.time(), "argv": sys.argv[:3]})
                           + "\n").encode())
        os.write(_fd, line)


# ---- engine core: the scheduler ---------------------------------------------------------

class _Bucket:
    def __init__(self):
        self.sec = int(time.time())
        self.calls = self.empty = 0
        self.sched_s = self.busy_s = self.idle_s = 0.0

    def flush_if_new(self, now):
        if int(now) != self.sec:
            if self.calls:
                log("steps", t=self.sec, calls=self.calls, empty=self.empty,
                    sched_s=round(self.sched_s, 4), busy_s=round(self.busy_s, 4),
                    idle_s=round(self.idle_s, 4))
            self.__init__()


_bucket = None
_last = {"end": 0.0, "tokens": 0}


def _patch_scheduler(module):
    cls = module.Scheduler
    add, schedule, update, free = (cls.add_request, cls.schedule, cls.update_from_output,
                                   cls._free_request)

    def add_request(self, request):
        log("add", rid=request.request_id, n=len(request.prompt_token_ids or ()),
            arrival=getattr(request, "arrival_time", None))
        return add(self, request)

    def schedule_(self, *args, **kwargs):
        global _bucket
        start = time.time()
        if _bucket is None:
            _bucket = _Bucket()
        _bucket.flush_if_new(start)
        out = schedule(self, *args, **kwargs)
        end = time.time()
        _bucket.calls += 1
        _bucket.sched_s += end - start
        tokens = out.total_num_scheduled_tokens
        if not tokens:
            _bucket.empty += 1
        for r in out.scheduled_new_reqs:
            log("first_sched", t=end, rid=r.req_id, computed=r.num_computed_tokens,
                tokens=out.num_scheduled_tokens.get(r.req_id, 0),
                waiting=len(self.waiting), running=len(self.running))
        _last["end"], _last["tokens"] = end, tokens
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        now = time.time()
        if _bucket is not None and _last["end"]:
            if _last["tokens"]:
                _bucket.busy_s += now - _last["end"]
            else:
                _bucket.idle_s += now - _last["end"]
        return update(self, scheduler_output, model_runner_output)

    def free_request(self, request, *args, **kwargs):
        log("free", rid=request.request_id, n=len(request.prompt_token_ids or ()),
            cached=getattr(request, "num_cached_tokens", None),
            external=getattr(request, "num_external_computed_tokens", None))
        return free(self, request, *args, **kwargs)

    cls.add_request, cls.schedule, cls.update_from_output, cls._free_request = (
        add_request, schedule_, update_from_output, free_request)


# ---- engine core: the connector ---------------------------------------------------------

def _patch_connector(module):
    cls = module.RaykvConnector
    gnm = cls.get_num_new_matched_tokens

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        start = time.time()
        out = gnm(self, request, num_computed_tokens)
        log("gnm", t=start, rid=request.request_id, dur=time.time() - start,
            local=num_computed_tokens, result=out[0])
        return out

    cls.get_num_new_matched_tokens = get_num_new_matched_tokens


def _patch_service(module):
    cls = module.Lookups
    poll, lookup = cls.poll, cls._lookup

    def poll_(self, request_id, tokens, salt_of, *rest):  # rest: the step's budget
        before = request_id in self._pending
        out = poll(self, request_id, tokens, salt_of, *rest)
        pending = self._pending.get(request_id)
        if not before and pending is not None:
            submitted = time.time()
            pending[0].add_done_callback(lambda f, rid=request_id, s=submitted: log(
                "lookup_done", rid=rid, submitted=s, total=time.time() - s))
        return out

    def lookup_(self, tokens, salt_of):
        start = time.time()
        try:
            return lookup(self, tokens, salt_of)
        finally:
            log("lookup_run", t=start, dur=time.time() - start, n=len(tokens))

    cls.poll, cls._lookup = poll_, lookup_


def _timed_io(name, method):
    """`method(self, spec, *rest)`, logged as `name` with its start, duration and tokens."""
    def timed(self, spec, *rest):
        start = time.time()
        try:
            return method(self, spec, *rest)
        finally:
            log(name, t=start, rid=spec.request_id, dur=time.time() - start,
                n=len(spec.token_ids) - spec.start)
    return timed


def _patch_io(module):
    cls = module.KVMover
    start_load = cls.start_load

    def start_load_(self, spec):
        log("load_submit", rid=spec.request_id, n=len(spec.token_ids) - spec.start)
        return start_load(self, spec)

    cls.start_load = start_load_
    cls.load = _timed_io("load", cls.load)
    cls.save = _timed_io("save", cls.save)
    cls._put = _timed_io("put", _put_as_asked(cls._put))


def _put_as_asked(put):
    """The saver thread's put, held back or niced as RAYKV_PHASES_SAVES asks."""
    if _SAVES == "now":
        return put

    def held(self, spec, kv):
        if _SAVES == "delay":
            time.sleep(SAVE_DELAY_S)
        else:
            from cluster.core.background import lower_priority

            lower_priority()
        return put(self, spec, kv)

    return held


# ---- the ingress: raykv's router --------------------------------------------------------

def _patch_router(module):
    cls = module.RaykvRouter
    choose, keys_of0, locate0 = cls.choose_replicas, cls._keys_of, cls._locate

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        start = time.time()
        out = await choose(self, candidate_replicas, pending_request)
        d = self.last_decision
        log("route", t=start, dur=time.time() - start, n_cand=len(candidate_replicas),
            chosen=out[0][0].replica_id.unique_id if out and out[0] else None,
            queue={r.replica_id.unique_id: self._replica_queue_len_cache.get(r.replica_id)
                   for r in candidate_replicas},
            est=None if d is None else [(e.replica_id, round(e.ttft_s, 4),
                                         round(e.queue_wait_s, 4), e.fetch_pages)
                                        for e in d.estimates],
            counters=dict(self.counters))
        self.last_decision = None
        return out

    async def keys_of(self, pending_request):
        start = time.time()
        out = await keys_of0(self, pending_request)
        log("keys", t=start, dur=time.time() - start, n=len(out) // 16)
        return out

    async def locate(self, keys_blob):
        start = time.time()
        out = await locate0(self, keys_blob)
        log("locate", t=start, dur=time.time() - start, n=len(out))
        return out

    cls.choose_replicas, cls._keys_of, cls._locate = choose_replicas, keys_of, locate


HOOKS = {"vllm.v1.core.sched.scheduler": _patch_scheduler,
         "cluster.serving.vllm_connector": _patch_connector,
         "cluster.serving.vllm_service": _patch_service,
         "cluster.serving.vllm_io": _patch_io,
         "cluster.serving.router": _patch_router}



# ---- the reply's way: vLLM's frontend, the LLMServer replica, the OpenAI ingress ----------

def _prompt_len(body):
    prompt = getattr(body, "prompt", None)
    return len(prompt) if isinstance(prompt, str) else None


def _timed_stream(kind, stream, **fields):
    """`stream` (an async generator) logging `kind` when it is done."""
    async def wrapped():
        try:
            async for item in stream:
                yield item
        finally:
            log(kind, **fields)
    return wrapped()


def _patch_output_processor(module):
    cls = module.OutputProcessor
    process = cls.process_outputs

    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        now = time.time()
        for out in engine_core_outputs:
            if getattr(out, "finish_reason", None) is not None:
                log("fout", t=now, rid=out.request_id)
        return process(self, engine_core_outputs, *args, **kwargs)

    cls.process_outputs = process_outputs


def _patch_llm_server(module):
    cls = module.LLMServer
    completions = cls.completions

    async def completions_(self, request, *args, **kwargs):
        start = time.time()
        stream = await completions(self, request, *args, **kwargs)
        log("srv_in", t=start, n=_prompt_len(request))
        return _timed_stream("srv_out", stream, n=_prompt_len(request), t0=start)

    cls.completions = completions_


def _patch_ingress(module):
    cls = module.OpenAiIngress
    completions = cls.completions

    @functools.wraps(completions)  # FastAPI reads the route's signature through __wrapped__
    async def completions_(self, body, request):
        start = time.time()
        try:
            return await completions(self, body, request)
        finally:
            log("ing", t=start, dur=time.time() - start, n=_prompt_len(body))

    cls.completions = completions_


HOOKS.update({"vllm.v1.engine.output_processor": _patch_output_processor,
              "ray.llm._internal.serve.core.server.llm_server": _patch_llm_server,
              "ray.llm._internal.serve.core.ingress.ingress": _patch_ingress})


class _PostImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        exec_module, hook = spec.loader.exec_module, HOOKS[name]

        def exec_and_patch(module):
            exec_module(module)
            try:
                hook(module)
                log("patched", module=name)
            except Exception as error:  # a diagnostic never breaks the run
                log("patch_failed", module=name, error=repr(error))

        spec.loader.exec_module = exec_and_patch
        return spec


if _DIR:
    sys.meta_path.insert(0, _PostImport())


# ---- Ray drivers' error listener: polls per second, and when it exits ----------------------

def _patch_ray_worker(module):
    original = module.listen_error_messages

    def listen_error_messages(worker, threads_stopped):
        inner = worker.gcs_error_subscriber

        class Counting:
            def __init__(self):
                self.n = self.none = 0
                self.sec = int(time.time())

            def poll(self, *args, **kwargs):
                out = inner.poll(*args, **kwargs)
                now = int(time.time())
                if now != self.sec:
                    log("errpoll", t=self.sec, n=self.n, none=self.none, argv=sys.argv[:1])
                    self.n = self.none = 0
                    self.sec = now
                self.n += 1
                self.none += out is None or out[1] is None
                return out

            def __getattr__(self, name):
                return getattr(inner, name)

        worker.gcs_error_subscriber = Counting()
        log("errlisten_start", argv=sys.argv[:1])
        try:
            return original(worker, threads_stopped)
        finally:
            log("errlisten_exit", argv=sys.argv[:1])

    module.listen_error_messages = listen_error_messages


if _DIR:
    HOOKS["ray._private.worker"] = _patch_ray_worker
