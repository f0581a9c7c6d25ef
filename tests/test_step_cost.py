"""The decode count of ``grpax.plan.step_cost`` against hand counts of what the paged engine runs: rows through
its slots in waves of C - 1 steps, every slot of a call computed, the pages its attention reads."""

from grpax.models.registry import ModelConfig
from grpax.plan.step_cost import StepShape, step_phases
from grpax.sampler.keys import SamplerConfig

# V=512, D=64, L=2, N=4, K=2, H=16, F=128, bfloat16 weights and cache.
TINY = ModelConfig(
    vocab_size=512, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
    dtype="bfloat16", weight_dtype="bfloat16",
)  # fmt: skip
# One slot's step: 2 x the layers' matmul params (2 x 2 x (2DNH + 2DKH + 3DF) = 147,456) + the head (2DV).
PER_SLOT = 147_456 + 2 * 64 * 512
ATTENTION = 4 * 2 * 4 * 16  # FLOPs per (query, key) pair: QK^T and PV over L layers and N heads of H
KV_TOKEN = 2 * 2 * 2 * 16 * 2  # bytes of one token's keys and values: L x (k, v) x K x H x 2 B
WEIGHTS = TINY.num_params() * 2  # bytes the sampler reads per step


def _decode(num_prompts, G, P, C, data=1, peak=1.0, **engine):
    """The counted decode phase of a step of ``num_prompts`` x G rows on one chip (``peak`` FLOP/s, 1 B/s)."""
    shape = {k: engine.pop(k) for k in ("decode_slots", "reads_filled_pages") if k in engine}
    s = StepShape(num_prompts, G, P, C, 1, 1, False, False, **shape, sampler=SamplerConfig(**engine))
    return next(p for p in step_phases(TINY, s, 1, 1, 1, data, peak, 1.0) if p.name == "decode")


# P = 4 prompt tokens, C = 6: each row decodes 5 steps (n = 1..5 tokens before the step; the prefill sampled the
# first). Pages of 4 tokens (the table: ceil(10 / 4) = 3 pages), calls of 2 steps, decode_phase_length 8 = 2
# pages. The call starting at n0 gets the pages through position min(P + n0 + 0, P + C - 2):
#   n0 = 1 (steps n = 1, 2): position 5 -> 2 pages -> rounded to 2 -> 8 keys per slot;
#   n0 = 3 (n = 3, 4): position 7 -> 2 pages -> 8 keys; n0 = 5 (n = 5): position 8 -> 3 pages -> 4, capped at 3 -> 12.
# So a slot gathers 8 + 8 + 8 + 8 + 12 = 44 keys over a wave's 5 steps.
GATHERED = dict(page_size=4, decode_steps_per_call=2, decode_phase_length=8)


def test_two_waves_through_fewer_slots_than_rows_are_counted_by_hand():
    # 3 prompts x G = 2: 6 rows, 4 slots. Wave 1: 4 rows on 4 slots (rows wait); wave 2: the last 2 rows on 2
    # slots (slot_counts(4) = 4, 2, 1). 5 steps each.
    decode = _decode(3, 2, 4, 6, decode_slots=4, **GATHERED)
    assert decode.flops == 5 * 4 * PER_SLOT + 5 * 2 * PER_SLOT + ATTENTION * (4 * 44 + 2 * 44)
    assert decode.flops == 6_524_928
    assert decode.bytes_per_chip == 10 * WEIGHTS + (4 * 44 + 2 * 44) * KV_TOKEN


def test_one_wave_when_the_slots_hold_every_row():
    # max_num_seqs 0: 6 slots, one wave of 5 steps: the same FLOPs, half the weight reads.
    decode = _decode(3, 2, 4, 6, decode_slots=0, **GATHERED)
    assert decode.flops == 5 * 6 * PER_SLOT + ATTENTION * 6 * 44 == 6_524_928
    assert decode.bytes_per_chip == 5 * WEIGHTS + 6 * 44 * KV_TOKEN
    # 8 slots: the 6 rows decode on 6 of them (slot_counts(8) = 8, 6, 4, 2, 1); without retire_rows on all 8,
    # the idle slots computed and their table rows gathered too.
    assert _decode(3, 2, 4, 6, decode_slots=8, **GATHERED) == decode
    idle = _decode(3, 2, 4, 6, decode_slots=8, retire_rows=False, **GATHERED)
    assert idle.flops == 5 * 8 * PER_SLOT + ATTENTION * 8 * 44
    assert idle.bytes_per_chip == 5 * WEIGHTS + 8 * 44 * KV_TOKEN


def test_slot_count_step_sets_the_last_waves_slots():
    # 5 rows (5 prompts x G = 1) on 8 slots: the default ladder of 8 (8, 6, 4, 2, 1) runs them on 6 slots, one
    # idle; slot_count_step=1 on 5. 5 steps each, every slot computed and its table row gathered (44 keys).
    ladder = _decode(5, 1, 4, 6, decode_slots=8, **GATHERED)
    exact = _decode(5, 1, 4, 6, decode_slots=8, slot_count_step=1, **GATHERED)
    assert ladder.flops == 5 * 6 * PER_SLOT + ATTENTION * 6 * 44
    assert exact.flops == 5 * 5 * PER_SLOT + ATTENTION * 5 * 44
    assert ladder.bytes_per_chip - exact.bytes_per_chip == 44 * KV_TOKEN


def test_the_decode_count_changes_with_max_num_seqs():
    # A chip bound by its memory: each step's time is its bytes (1 B/s).
    counts = {slots: _decode(3, 2, 4, 6, peak=1e30, decode_slots=slots, **GATHERED) for slots in (0, 4, 2)}
    # 2 slots: three waves of 2 rows, 15 steps.
    assert counts[2].bytes_per_chip == 15 * WEIGHTS + 6 * 44 * KV_TOKEN
    assert counts[4].bytes_per_chip - counts[0].bytes_per_chip == 5 * WEIGHTS
    assert counts[2].bytes_per_chip - counts[4].bytes_per_chip == 5 * WEIGHTS
    assert [counts[n].seconds for n in (0, 4, 2)] == [counts[n].bytes_per_chip for n in (0, 4, 2)]


def test_the_ragged_kernel_reads_filled_pages_the_gather_its_cut_table():
    # 1 prompt x G = 2, P = 4, C = 10: 9 steps on 2 slots; pages of 4, calls of 4 steps, decode_phase_length 8.
    shape = dict(page_size=4, decode_steps_per_call=4, decode_phase_length=8)
    # Filled pages: a sequence attends P + n = 5..13 keys: pages 2, 2, 2, 2, 3, 3, 3, 3, 4 -> 96 keys per slot.
    # Pallas's kernel runs every slot on each chip: the data axis does not split them.
    filled = _decode(1, 2, 4, 10, data=2, reads_filled_pages=True, **shape)
    assert filled.flops == 9 * 2 * PER_SLOT + ATTENTION * 2 * 96
    assert filled.bytes_per_chip == 9 * WEIGHTS + 2 * 96 * KV_TOKEN
    # Gathered (table ceil(14 / 4) = 4 pages): the call at n0 = 1 through position 7 -> 2 pages (8 keys, 4 steps);
    # n0 = 5 through 11 -> 3 pages -> 4 (16 keys, 4 steps); n0 = 9 through min(15, 12) -> 4 pages (16 keys, 1
    # step): 4 * 8 + 5 * 16 = 112 keys per slot; the data axis splits the 2 slots.
    gathered = _decode(1, 2, 4, 10, data=2, **shape)
    assert gathered.flops == 9 * 2 * PER_SLOT + ATTENTION * 2 * 112
    assert gathered.bytes_per_chip == 9 * WEIGHTS + 112 * KV_TOKEN
    # decode_phase_length 0: the whole table (16 keys) at every step.
    whole = _decode(1, 2, 4, 10, data=2, **{**shape, "decode_phase_length": 0})
    assert whole.bytes_per_chip == 9 * WEIGHTS + 9 * 16 * KV_TOKEN


def test_a_one_token_completion_decodes_nothing():
    # The prefill samples the only token.
    decode = _decode(2, 2, 4, 1, **GATHERED)
    assert (decode.flops, decode.bytes_per_chip, decode.seconds) == (0.0, 0.0, 0.0)


def test_the_count_is_what_the_engine_runs_when_every_row_runs_to_c(monkeypatch):
    """The engine (XLA backend: the gathered pages) on prompts of P tokens that never stop: the calls it makes
    (slots, the page table's width, steps) give the count's FLOPs and bytes. 2 prompts x G = 3 rows in 4 slots:
    the second group is split over the two waves (its third row waits prefilled)."""
    import jax

    import grpax.sampler.engine as engine_module
    from grpax.models.params import init_params
    from grpax.sampler.engine import Engine
    from grpax.sampler.keys import SamplerConfig

    calls = []  # (slots, table width, steps) of each decode call
    real = engine_module.compiled_decode

    def spy(backend):
        fn = real(backend)

        def run(prepared, pages, slots, *args, **kwargs):
            pages, out = fn(prepared, pages, slots, *args, **kwargs)
            calls.append((*slots["page_table"].shape, int(out["steps"])))
            return pages, out

        return run

    monkeypatch.setattr(engine_module, "compiled_decode", spy)
    sc = SamplerConfig(
        max_prompt_length=4, max_completion_length=6, greedy=True, backend="xla", max_num_seqs=4, **GATHERED
    )
    engine = Engine(init_params(TINY, jax.random.key(0)), TINY, sc)
    prompts = [[5, 9, 11, 3], [6, 9, 11, 3]]
    request = engine.submit(prompts, jax.random.key(1), 3)
    engine.run(request)
    assert all(seq.n == 6 for seq in request.sequences)  # every row ran to C
    # Per wave calls of 2, 2 and 1 steps on tables of 2, 2 and 3 pages (the hand count above).
    assert calls == [(4, 2, 2), (4, 2, 2), (4, 3, 1), (2, 2, 2), (2, 2, 2), (2, 3, 1)]
    steps = sum(n for _, _, n in calls)
    keys = sum(S * width * 4 * n for S, width, n in calls)
    decode = _decode(2, 3, 4, 6, decode_slots=4, **GATHERED)
    assert decode.flops == sum(S * n for S, _, n in calls) * PER_SLOT + ATTENTION * keys
    assert decode.bytes_per_chip == steps * WEIGHTS + keys * KV_TOKEN
