"""vLLM as rltrain's generation engine, split by concern:

- ``engine``: ``engine=vllm``, vLLM's ``LLM`` in a process of rltrain's own (``VLLMEngine``);
- ``server``: ``engine=vllm_server``, a vLLM server the user runs (``VLLMServer``);
- ``claim``: a server serves one run at a time (who holds it, and the ledger its worker keeps);
- ``extension``: the worker extension a server runs with (rltrain's calls through ``/collective_rpc``);
- ``requests``: sampling settings into vLLM requests, completions back into ``Generated``;
- ``loading``: weights into vLLM's model in place (``VLLMModel``), and what is served (``served_weights``);
- ``slots``: ``sync=vllm``, snapshots in shared memory that the engine loads before each generation;
- ``transfer``: ``sync=vllm_transfer``, pushes through vLLM's weight-transfer API (gloo, nccl, ipc);
- ``backends``: vLLM's trainer-side transfer engines, and rltrain's gloo backend registered into vLLM;
- ``aside``: calls that may never return, waited for with a bound.

Nothing here imports vLLM at import time but ``backends`` (the learner needs vLLM only to push through
its API, or to run its own engine).
"""

BACKENDS = {"gloo": "rltrain_gloo", "nccl": "nccl", "ipc": "ipc"}  # sync.backend -> vLLM's weight-transfer backend
