"""A smoke run of the benchmarks (`python -m benchmarks.run --quick`) on one tiny case,
and of `python -m benchmarks.scaling --quick` on one device and two processes.

Speed is never asserted here: this checks that the harness runs, that the JSON holds
what the docs report, and that the numbers it records are consistent.
"""

import json

import pytest

from benchmarks import run, scaling


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    argv = ["--quick", "--cases", "mlp2x16", "--depths", "2", "3", "--reps", "1"]
    argv += ["--min-time", "0.001", "--out", str(out)]
    returned = run.main(argv)
    return returned, json.loads(out.read_text()), out


def test_json_has_every_section(results):
    _, saved, out = results
    assert set(saved) >= {
        "machine",
        "settings",
        "steps",
        "compile_cost",
        "host_callback",
        "targets",
        "wall_s",
    }
    host = saved["host_callback"]
    assert set(host) == {
        "no callback",
        "jax.debug.callback",
        "jax.debug.callback ordered",
        "jhooks.host",
    }
    assert all(r["call_s"] > 0 for r in host.values())
    machine = saved["machine"]
    assert machine["cores"] >= 1 and machine["cpu"]
    assert set(machine["versions"]) >= {"jax", "jaxlib", "equinox", "optax", "torch", "jhooks"}
    assert out.with_suffix(".md").read_text().count("| ") > 10


def test_step_case(results):
    _, saved, _ = results
    case = saved["steps"]["mlp2x16"]
    names = [name for name, _, _ in run.variant_names()]
    assert {"plain", "value:identity", "value:clip", "value:host"} <= set(names)
    for name in names:
        v = case["variants"][f"jhooks {name}"]
        assert len(v["times_s"]) == saved["settings"]["reps"]
        assert v["step_s"] > 0 and v["compile_s"] > 0
        assert set(v["memory"]) == {"argument_size", "output_size", "alias_size", "temp_size"}
        assert v["ops"]["dot"] > 0
        assert v["lowered_ops"]["stablehlo.dot_general"] > 0
        if name != "plain":
            assert case["ratios"][f"jhooks {name} / jhooks plain"] > 0
        if not name.endswith("idle"):
            assert case["variants"][f"torch {name}"]["step_s"] > 0
            assert case["ratios"][f"jhooks {name} / torch {name}"] > 0
    # The same weights and batch give the same loss in both frameworks.
    assert case["loss_check"]["abs_diff"] < 1e-5 * max(1.0, abs(case["loss_check"]["jax_loss"]))
    # An identity value hook compiles to the plain program; a clip hook adds a clamp.
    plain = case["variants"]["jhooks plain"]
    assert case["variants"]["jhooks value:identity"]["ops"] == plain["ops"]
    assert case["variants"]["jhooks value:identity"]["memory"] == plain["memory"]
    assert case["variants"]["jhooks value:clip"]["ops"].get("clamp", 0) > plain["ops"].get(
        "clamp", 0
    )
    assert case["variants"]["jhooks value:host"]["ops"].get("custom-call", 0) > plain["ops"].get(
        "custom-call", 0
    )


def test_compile_cost_and_targets(results):
    _, saved, _ = results
    assert set(saved["compile_cost"]) == {"2", "3"}
    for row in saved["compile_cost"].values():
        assert row["plain"]["total_s"] > 0
        assert row["value:identity"]["ratio_to_plain"] > 0
    targets = saved["targets"]
    assert {t["target"] for t in targets} >= {
        "identity hooks: step time / plain",
        "identity hooks: same compiled operations",
        "identity hooks: same memory",
        "gradient-modifying hooks: step time / plain",
        "compile time, hooks on every layer / none",
    }
    for t in targets:
        assert isinstance(t["pass"], bool)


def _fake_results(strict, passed):
    return {
        "settings": {"strict": strict},
        "targets": [{"target": "t", "where": "w", "value": 1.0, "limit": 1.0, "pass": passed}],
    }


@pytest.mark.parametrize(
    ("strict", "passed", "status"),
    [(False, True, 0), (False, False, 0), (True, True, 0), (True, False, 1)],
)
def test_exit_status_fails_on_a_miss_only_with_strict(monkeypatch, strict, passed, status):
    monkeypatch.setattr(run, "main", lambda argv=None: _fake_results(strict, passed))
    assert run.cli([]) == status


def test_exit_status_2_for_bad_arguments():
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--no-such-option"])
    assert exit_info.value.code == 2


@pytest.fixture(scope="module")
def scaling_results(tmp_path_factory):
    """`benchmarks.scaling --quick` on one device and on two processes of two devices."""
    out = tmp_path_factory.mktemp("scaling") / "scaling.json"
    argv = ["--quick", "--sizes", "1", "--processes", "2", "--reps", "2", "--out", str(out)]
    return scaling.main(argv), json.loads(out.read_text())


def test_scaling_smoke(scaling_results):
    returned, saved = scaling_results
    assert [r["setup"] for r in saved["setups"]] == [
        "1 process, 1 device",
        "2 processes x 2 devices",
    ]
    one, two = saved["setups"]
    assert (one["devices"], one["processes"]) == (1, 1)
    assert (two["devices"], two["processes"]) == (4, 2)
    for r in saved["setups"]:
        assert set(r["step_s"]) == {"plain", "clipped", "dp_sgd"}
        for variant, times in r["raw"]["times_s"].items():
            assert len(times) == 2 and all(t > 0 for t in times)
            assert len(r["raw"]["cpu_times_s"][variant]) == 2
            assert r["per_example_s"][variant] == r["step_s"][variant] / r["batch"]
        for variant, ratio in r["ratios"].items():
            assert ratio > 0 and r["cpu_ratios"][variant] > 0
            assert r["vs_one_device"][variant] == pytest.approx(ratio / one["ratios"][variant])
            assert r["pass"][variant] == (r["vs_one_device"][variant] <= scaling.TARGET)
    # One device has no collective; the batch split over both processes' devices reduces
    # the gradient with one all-reduce, in the plain step and in both clipped steps.
    assert one["collectives"] == {"plain": {}, "clipped": {}, "dp_sgd": {}}
    assert all(c == {"all-reduce": 1} for c in two["collectives"].values())
    assert returned["setups"][1]["ratios"] == two["ratios"]
