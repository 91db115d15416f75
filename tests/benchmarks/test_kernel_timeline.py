"""benchmarks/kernel_timeline.py: a synthetic trace whose busy, idle and per-kind times are known."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from kernel_timeline import by_name, kind_of, summarize  # noqa: E402


def test_kinds_of_real_kernel_names():
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert kind_of("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kind_of("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT") == "gemm"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kind_of("_add_rmsnorm_rows_kernel") == "comm"
    assert kind_of("push_allreduce_rmsnorm_kernel") == "comm"
    assert kind_of("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "comm"
    assert kind_of("triton_poi_fused__unsafe_view_mul_silu_3") == "other"
    assert kind_of("_combine_kernel") == "attention"


def test_busy_idle_and_kinds_of_a_known_timeline(seed):
    rng = random.Random(seed)
    t, events, expect = 10.0 * rng.random(), [], {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    busy = 0.0
    start = t
    for i in range(20):
        kind = rng.choice(list(expect))
        name = {"gemm": "nvjet_tst_x", "attention": "fmha_fwd", "other": "triton_poi_fused_add_0"}[kind]
        d = 1 + 50 * rng.random()
        events.append({"cat": "kernel", "name": name, "ts": t, "dur": d})
        expect[kind] += d
        busy += d
        # a second compute kernel entirely inside this one (another stream): adds no busy time
        inner = d * rng.random() / 2
        events.append({"cat": "kernel", "name": "triton_poi_fused_mul_1", "ts": t + inner / 2, "dur": inner})
        expect["other"] += inner
        gap = 20 * rng.random()
        # communication during the gap: neither busy nor counted as compute
        events.append({"cat": "kernel", "name": "_add_rmsnorm_rows_kernel", "ts": t + d, "dur": gap})
        events.append({"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": t + d, "dur": gap / 2})
        t += d + gap
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": start - 100, "dur": 1e6})  # not GPU: ignored
    row = summarize(events)
    wall = t - start
    assert row["wall_us"] == pytest.approx(wall, abs=0.2)
    assert row["busy_us"] == pytest.approx(busy, abs=0.2)
    assert row["idle_us"] == pytest.approx(wall - busy, abs=0.3)
    for kind, us in expect.items():
        assert row[f"{kind}_us"] == pytest.approx(us, abs=0.2)
    assert row["comm_n"] == 20 and row["memcpy_n"] == 20
    assert row["gemm_n"] + row["attention_n"] + row["other_n"] == 40


def test_a_trace_without_gpu_events_is_an_error():
    with pytest.raises(ValueError, match="no GPU kernel"):
        summarize([{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])


def test_by_name_sums_each_kernel_and_ranks_them():
    events = [{"cat": "kernel", "name": "nvjet_a", "ts": 0, "dur": 5.0},
              {"cat": "kernel", "name": "fmha_b", "ts": 5, "dur": 7.0},
              {"cat": "kernel", "name": "nvjet_a", "ts": 12, "dur": 4.0},
              {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 16, "dur": 1.0},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99.0}]
    assert by_name(events) == [("gemm", "nvjet_a", 9.0, 2), ("attention", "fmha_b", 7.0, 1),
                               ("memcpy", "Memcpy DtoD", 1.0, 1)]
    assert by_name(events, top=1) == [("gemm", "nvjet_a", 9.0, 2)]
