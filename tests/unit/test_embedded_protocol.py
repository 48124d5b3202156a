"""The messages between the embedded engine's client and its process (`rollout/embedded_protocol.py`).

Every record survives the trip the engine's queues give it (pickle; a torch
multiprocessing queue for the shared-memory weight buckets), each channel names
the kind of a message it does not carry, and a dispatcher needs one handler per kind.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.multiprocessing as mp

from entr_megatron.rollout import embedded_protocol as protocol
from entr_megatron.rollout.embedded_protocol import (
    COMMANDS,
    EVENTS,
    WEIGHTS,
    Abort,
    BeginUpdate,
    Bucket,
    CallFailed,
    CancelUpdate,
    EmbeddedEngineConfig,
    EndUpdate,
    Fatal,
    GetHealth,
    Pause,
    ProtocolError,
    Ready,
    Reply,
    Results,
    Resume,
    RunReceiver,
    Shutdown,
    Staged,
    Submit,
)
from entr_megatron.rollout.engine import (
    EngineError,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    WeightReceiver,
    WeightUpdateReport,
)
from entr_megatron.rollout.weights import TensorSpec, pack_buckets


class _NoopReceiver(WeightReceiver):
    """A picklable receiver (module level) that writes nothing."""

    def __init__(self, tag: str = "noop"):
        self.tag = tag

    def receive(self, stage) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoopReceiver) and other.tag == self.tag


def _result(request_id: str = "r0") -> GenerateResult:
    return GenerateResult(request_id=request_id, sample_index=1, prompt_ids=[1, 2], output_ids=[3],
                          logprobs=[-0.5], versions=[2], finish_reason="stop", entropy=[0.7])


def _bucket() -> Bucket:
    named = [("a.weight", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b.bias", torch.ones(4))]
    (bucket,) = pack_buckets(named, 1 << 20, share_memory=True)
    return Bucket(call_id=7, bucket=bucket)


def _tensor_free_messages() -> list[object]:
    """One message of every kind but Bucket (its tensor has no plain ==)."""
    report = WeightUpdateReport(version=3, num_tensors=2, num_bytes=40, transfer_s=0.1, swap_s=0.01, wait_s=0.0,
                                total_s=0.2, decode_steps_during_transfer=5, running_at_swap=1)
    return [
        Submit((GenerateRequest([1, 2, 3], SamplingParams(temperature=0.5, n=2), request_id="r0"),)),
        Abort(("r0", "r1")),
        CancelUpdate(),
        Pause(1),
        Resume(2),
        GetHealth(3),
        Staged(call_id=4, t_call=12.5, steps_at_begin=9),
        Shutdown(),
        RunReceiver(call_id=5, version=3, t_call=1.0, receiver=_NoopReceiver()),
        BeginUpdate(call_id=6, version=4, t_call=2.0),
        EndUpdate(call_id=6, sender_error=None),
        EndUpdate(call_id=6, sender_error="RuntimeError('boom')"),
        Ready(specs={"a.weight": TensorSpec((2, 3), torch.bfloat16)}, version=0, vocab_size=32, max_model_len=None,
              eos_token_ids=(2,)),
        Results((_result("r0"), _result("r1"))),
        Reply(1, None),
        Reply(3, EngineHealth(alive=True, weight_version=3, last_update=report)),
        Reply(6, report),
        CallFailed(6, "weight update: 1 tensor missing"),
        Fatal("Traceback (most recent call last): ..."),
    ]


def _assert_same_bucket(got: Bucket, sent: Bucket) -> None:
    assert type(got) is Bucket and got.call_id == sent.call_id
    assert got.bucket.entries == sent.bucket.entries
    assert torch.equal(got.bucket.flat, sent.bucket.flat)


@pytest.mark.parametrize("msg", _tensor_free_messages(), ids=lambda m: type(m).__name__)
def test_every_record_round_trips_through_pickle(msg):
    got = pickle.loads(pickle.dumps(msg))
    assert type(got) is type(msg) and got == msg


def test_bucket_round_trips_through_pickle():
    sent = _bucket()
    _assert_same_bucket(pickle.loads(pickle.dumps(sent)), sent)


def test_records_cross_a_torch_multiprocessing_queue():
    """The queues the engine uses (spawn context): records, and a bucket in shared memory."""
    q = mp.get_context("spawn").Queue()
    try:
        sent = [*_tensor_free_messages(), _bucket()]
        for msg in sent:
            q.put(msg)
        got = [q.get(timeout=30) for _ in sent]
    finally:
        q.cancel_join_thread()
        q.close()
    for g, s in zip(got[:-1], sent[:-1]):
        assert type(g) is type(s) and g == s
    _assert_same_bucket(got[-1], sent[-1])


def test_records_are_frozen():
    with pytest.raises(AttributeError):
        Pause(1).call_id = 2  # type: ignore[misc]


def test_records_of_different_kinds_differ():
    assert Pause(1) != Resume(1) != GetHealth(1)


def test_each_record_belongs_to_exactly_one_channel():
    channels = (COMMANDS, WEIGHTS, EVENTS)
    records = [getattr(protocol, n) for n in protocol.__all__
               if isinstance(getattr(protocol, n), type) and n[0].isupper() and not n.isupper()]
    records = [r for r in records if r not in (protocol.Channel, EmbeddedEngineConfig, ProtocolError)]
    assert records
    for r in records:
        assert sum(r in c.kinds for c in channels) == 1, r.__name__
    assert {k for c in channels for k in c.kinds} == set(records)
    assert {type(m) for m in _tensor_free_messages()} | {Bucket} == set(records)


def test_decode_returns_a_known_message():
    msg = GetHealth(3)
    assert COMMANDS.decode(msg) is msg


@pytest.mark.parametrize("channel, msg, kind", [
    (COMMANDS, ("call", 0, "health", ()), "tuple"),  # the old tuple protocol
    (COMMANDS, BeginUpdate(0, 1, 0.0), "BeginUpdate"),  # a record of another channel
    (WEIGHTS, None, "NoneType"),
    (EVENTS, Submit(()), "Submit"),
])
def test_decode_names_an_unknown_message_kind(channel, msg, kind):
    with pytest.raises(ProtocolError, match=f"{channel.name} queue: unknown message kind '{kind}'") as info:
        channel.decode(msg)
    assert isinstance(info.value, EngineError)
    for k in channel.kinds:
        assert k.__name__ in str(info.value)


def test_dispatcher_calls_the_handler_of_each_kind():
    seen = []
    handlers = {k: (lambda m, k=k: seen.append((k, m)) or k.__name__) for k in EVENTS.kinds}
    dispatch = EVENTS.dispatcher(handlers)
    assert dispatch(Reply(1, 5)) == "Reply"
    assert dispatch(Fatal("x")) == "Fatal"
    assert seen == [(Reply, Reply(1, 5)), (Fatal, Fatal("x"))]
    with pytest.raises(ProtocolError, match="unknown message kind 'Pause'"):
        dispatch(Pause(1))


def test_dispatcher_needs_one_handler_per_kind():
    handlers = {k: print for k in COMMANDS.kinds if k is not Shutdown}
    with pytest.raises(ValueError, match="command handlers cover"):
        COMMANDS.dispatcher(handlers)
    with pytest.raises(ValueError, match="command handlers cover"):
        COMMANDS.dispatcher({**handlers, Shutdown: print, Fatal: print})


def test_config_is_the_one_the_client_exports():
    from entr_megatron.rollout import embedded

    assert embedded.EmbeddedEngineConfig is EmbeddedEngineConfig
    assert embedded.KV_ON_UPDATE is protocol.KV_ON_UPDATE
    cfg = EmbeddedEngineConfig(model_dir="/nowhere", dtype="bfloat16", num_threads=1)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(ValueError, match="EmbeddedEngineConfig.attn_implementation"):
        EmbeddedEngineConfig(model_dir="/nowhere", attn_implementation="flash")
