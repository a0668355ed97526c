"""Tests for the head/dimension allocation law, its fit, the advisor and `hdi-monitor allocate`."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from itertools import pairwise

import numpy as np
import pytest
import scipy.optimize

from hdi_monitor.cli import main
from hdi_monitor.contrib.allocation import (
    AllocationLaw,
    AllocationRun,
    feasible_head_dims,
    fit_allocation_law,
    load_sweep,
    load_sweep_csv,
    optimal_head_dim,
    recommend_allocation,
)

TRUE = AllocationLaw(sigma2=0.05, a=2.0, alpha=0.8, c=3.0, beta=6.0, rho=0.3)


def _hand_loss(law: AllocationLaw, H: float, d: float, N: float, rho: float | None = None) -> float:
    """The documented formula, written out independently of the library."""
    r = law.rho if rho is None else rho
    return (
        law.sigma2 + law.a * d ** (-law.alpha) + law.c * N ** (-2 * law.beta / (2 * law.beta + d)) * (r + (1 - r) / H)
    )


def _synthetic_sweep(law: AllocationLaw, seed: int, noise: float = 0.03, budgets=(64, 128, 256)) -> list[AllocationRun]:
    rng = np.random.default_rng(seed)
    runs = []
    for D in budgets:
        for d in (4, 8, 16, 32, 64):
            if d > D:
                continue
            for N in (1e3, 1e4, 1e5, 1e6):
                loss = _hand_loss(law, D // d, d, N) * math.exp(rng.normal(0.0, noise))
                runs.append(AllocationRun(D // d, d, N, loss))
    return runs


def _divisors(D: int) -> list[int]:
    return [d for d in range(1, D + 1) if D % d == 0]


# --------------------------------------------------------------------------------------------
# The law
# --------------------------------------------------------------------------------------------


def test_predict_matches_the_documented_formula():
    law = AllocationLaw(sigma2=0.1, a=2.0, alpha=0.5, c=3.0, beta=1.5, rho=0.2)
    # 0.1 + 2/4 + 3 * 100^(-3/19) * (0.2 + 0.8/4)
    expected = 0.1 + 0.5 + 3.0 * 100.0 ** (-3.0 / 19.0) * 0.4
    assert law.predict(4, 16, 100) == pytest.approx(expected, rel=1e-14)
    # a measured correlation replaces rho
    assert law.predict(4, 16, 100, correlation=0.6) == pytest.approx(
        0.6 + 3.0 * 100.0 ** (-3.0 / 19.0) * 0.7, rel=1e-14
    )
    t = law.terms(np.array([1, 4]), np.array([64, 16]), 100)
    assert np.allclose(t["noise"] + t["approximation"] + t["estimation"] * t["ensemble_factor"], t["loss"])
    assert t["ensemble_factor"][0] == pytest.approx(1.0)  # one head: no averaging
    assert np.allclose(law.predict([1, 4], [64, 16], 100), [_hand_loss(law, 1, 64, 100), expected])


@pytest.mark.parametrize(
    "kwargs",
    [{"a": 0.0}, {"alpha": -1.0}, {"beta": float("nan")}, {"rho": 1.5}, {"sigma2": -0.1}, {"c": float("inf")}],
)
def test_law_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        AllocationLaw(**kwargs)
    with pytest.raises(ValueError, match="unknown parameter"):
        AllocationLaw().replace(gamma=1.0)


def _hand_dloss_dd(law: AllocationLaw, d: float, D: float, N: float) -> float:
    """dL(D/d, d, N)/dd of the documented law, differentiated by hand."""
    g = law.rho + (1 - law.rho) * d / D  # the ensemble factor at H = D / d
    estim = law.c * N ** (-2 * law.beta / (2 * law.beta + d))
    slope = 2 * law.beta * math.log(N) / (2 * law.beta + d) ** 2
    return -law.alpha * law.a * d ** (-law.alpha - 1) + estim * (g * slope + (1 - law.rho) / D)


LAWS = [AllocationLaw(), TRUE, AllocationLaw(sigma2=0.0, a=0.3, alpha=2.0, c=5.0, beta=2.0, rho=0.05)]


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("D, N", [(768, 1e6), (256, 1e3), (4096, 1e9), (64, 30.0)])
def test_continuous_optimum_is_the_root_of_the_hand_derivative_and_beats_a_dense_grid(law, D, N):
    ours = optimal_head_dim(D, N, law)
    # brute force: no point of a 200,001-point log grid over [1, D] is lower
    grid = np.exp(np.linspace(0.0, math.log(D), 200_001))
    brute = float(np.min(_hand_loss(law, D / grid, grid, N)))  # the hand formula broadcasts over numpy arrays
    assert _hand_loss(law, D / ours, ours, N) <= brute * (1 + 1e-12)
    if 1.0001 < ours < D / 1.0001:  # interior: dL/dd = 0 there, solved independently with brentq
        root = scipy.optimize.brentq(lambda d: _hand_dloss_dd(law, d, D, N), ours / 1.2, ours * 1.2, xtol=1e-13)
        assert ours == pytest.approx(root, rel=1e-6)
    else:  # on an edge: the slope points out of the range
        assert _hand_dloss_dd(law, ours, D, N) * (1 if ours < 2 else -1) > 0


@pytest.mark.parametrize("d_star", [3.0, 37.0, 181.5])
def test_continuous_optimum_of_a_law_built_to_have_a_known_optimum(d_star):
    # rho = 1 makes the ensemble factor 1, so dL/dd = 0 reads
    #   alpha a d^(-alpha-1) = c N^(-2 beta/(2 beta + d)) 2 beta ln N / (2 beta + d)^2;
    # solving it for `a` at d = d_star builds a law whose optimum is d_star, for any D >= d_star.
    alpha, c, beta, N = 0.7, 2.0, 5.0, 1e7
    a = c * N ** (-2 * beta / (2 * beta + d_star)) * 2 * beta * math.log(N) / (2 * beta + d_star) ** 2
    a *= d_star ** (alpha + 1) / alpha
    law = AllocationLaw(sigma2=0.01, a=a, alpha=alpha, c=c, beta=beta, rho=1.0)
    for D in (256, 1024):
        assert optimal_head_dim(D, N, law) == pytest.approx(d_star, rel=1e-7)
    # a bound inside the basin is respected exactly
    assert optimal_head_dim(1024, N, law, bounds=(1.0, d_star / 2)) == pytest.approx(d_star / 2, rel=1e-9)


def test_keyword_only_options():
    law = AllocationLaw()
    with pytest.raises(TypeError):
        law.predict(4, 16, 100, 0.5)  # correlation is keyword-only
    with pytest.raises(TypeError):
        optimal_head_dim(768, 1e6, law, (8.0, 256.0))
    with pytest.raises(TypeError):
        feasible_head_dims(768, 8, 256)
    assert feasible_head_dims(768, min_head_dim=8, max_head_dim=256) == [d for d in _divisors(768) if 8 <= d <= 256]


def test_missing_scipy_gives_an_install_hint(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # `import scipy.optimize` now raises ImportError
    assert AllocationLaw().predict(4, 16, 100) > 0  # the law itself needs no scipy
    with pytest.raises(ImportError, match=r"hdi-monitor\[advisor\]"):
        optimal_head_dim(768, 1e6)
    with pytest.raises(ImportError, match=r"hdi-monitor\[advisor\]"):
        fit_allocation_law(_synthetic_sweep(TRUE, 0))
    assert main(["allocate", "--budget", "768", "--train-size", "1e6"]) == 2
    err = capsys.readouterr().err
    assert "hdi-monitor[advisor]" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# The advisor
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 96, 120, 256, 384, 512, 768, 1000, 1024, 2048, 3072, 5120])
def test_split_multiplies_to_budget_and_is_the_brute_force_argmin(D):
    law = AllocationLaw()
    for N in (1e2, 1e4, 1e6, 1e9):
        rec = recommend_allocation(D, N, law)
        assert rec.num_heads * rec.head_dim == D
        expected_dims = [d for d in _divisors(D) if 8 <= d <= 256]
        assert [o.head_dim for o in rec.table] == expected_dims
        assert all(o.num_heads * o.head_dim == D for o in rec.table)
        losses = [_hand_loss(law, D // d, d, N) for d in expected_dims]
        assert rec.head_dim == expected_dims[int(np.argmin(losses))]
        assert rec.predicted_loss == pytest.approx(min(losses), rel=1e-12)
        assert sum(o.is_best for o in rec.table) == 1
        assert 8 <= rec.continuous_head_dim <= min(256, D)


def test_dk_star_grows_roughly_linearly_in_log_n():
    law = AllocationLaw()
    ns = np.logspace(2, 12, 21)
    cont = np.array([optimal_head_dim(768, n, law) for n in ns])
    assert np.all(np.diff(cont) > 0)
    assert cont[-1] > 2.5 * cont[0]  # grows over the ten decades
    slope, intercept = np.polyfit(np.log(ns), cont, 1)
    pred = slope * np.log(ns) + intercept
    r2 = 1 - np.sum((cont - pred) ** 2) / np.sum((cont - cont.mean()) ** 2)
    assert r2 > 0.99  # d_k* ~ log N up to a log log N factor
    # per decade, d_k* grows by a roughly constant amount (within a factor of 1.6)
    steps = np.diff(cont[::2])
    assert steps.max() / steps.min() < 1.6
    # the discrete (divisor) recommendation is non-decreasing in N for every budget, and moves
    for D in (64, 96, 256, 384, 768, 1024, 3072, 4096, 12288):
        dims = [recommend_allocation(D, n, law).head_dim for n in ns]
        assert all(b >= a for a, b in pairwise(dims)), (D, dims)
        assert dims[-1] > dims[0]


def test_dk_star_is_monotone_for_random_laws_in_the_asymptotic_regime():
    # The README's claim: d_k* is non-decreasing in N wherever 2 beta ln N / (2 beta + d_k*) > 1.
    rng = np.random.default_rng(0)
    ns = np.logspace(0, 12, 31)
    for _ in range(20):
        law = AllocationLaw(
            sigma2=0.0,
            a=float(np.exp(rng.normal(0, 1.5))),
            alpha=float(np.exp(rng.uniform(-1, 1))),
            c=float(np.exp(rng.normal(0, 1.5))),
            beta=float(np.exp(rng.uniform(-1, 3.5))),
            rho=float(rng.uniform(0, 1)),
        )
        D = int(rng.choice([64, 256, 768, 4096]))
        ds = np.array([optimal_head_dim(D, n, law) for n in ns])
        regime = 2 * law.beta * np.log(ns) / (2 * law.beta + ds) > 1
        pair = regime[:-1] & regime[1:]
        assert np.all(np.diff(ds)[pair] >= -1e-6 * ds[:-1][pair]), law


def test_head_count_is_nearly_linear_in_budget():
    law = AllocationLaw()
    budgets = [2**k for k in range(7, 15)]
    for N in (1e4, 1e6, 1e8):
        h_cont = [D / optimal_head_dim(D, N, law) for D in budgets]
        slope = np.polyfit(np.log(budgets), np.log(h_cont), 1)[0]
        assert 0.9 < slope <= 1.0
        h_disc = [recommend_allocation(D, N, law).num_heads for D in budgets]
        assert all(b >= a for a, b in pairwise(h_disc))
        # H*/D stays within a factor of 2 over two orders of magnitude of D
        ratios = np.array(h_disc) / np.array(budgets)
        assert ratios.max() / ratios.min() <= 2.0
    # analytic case: with rho = 1 the ensemble factor is constant, so d_k* does not depend on D
    # and H* = D / d_k* is exactly linear
    law1 = law.replace(rho=1.0)
    d_star = [optimal_head_dim(D, 1e6, law1, bounds=(1.0, 128.0)) for D in budgets]
    assert np.allclose(d_star, d_star[0], rtol=1e-6)


def test_current_split_is_marked_even_outside_the_range():
    rec = recommend_allocation(768, 1e6, current_heads=8)
    cur = [o for o in rec.table if o.is_current]
    assert len(cur) == 1 and cur[0].num_heads == 8 and cur[0].head_dim == 96 and rec.current == cur[0]
    assert rec.current.relative_to_best == pytest.approx(rec.current.predicted_loss / rec.predicted_loss - 1)
    rec = recommend_allocation(768, 1e6, current_heads=768)  # d_k = 1: outside [8, 256]
    assert rec.current is not None and rec.current.head_dim == 1 and not rec.current.in_range
    assert not rec.current.is_best and rec.table[0].head_dim == 1
    assert "current" in rec.format_table() and "current" in rec.to_markdown()


@pytest.mark.parametrize("args, match", [((7, 1e6), "no divisor"), ((768, 0.5), "n_train"), ((0, 1e6), "total_dim")])
def test_recommend_input_checks(args, match):
    with pytest.raises(ValueError, match=match):
        recommend_allocation(*args)


def test_recommend_rejects_bad_options():
    with pytest.raises(ValueError, match="does not divide"):
        recommend_allocation(768, 1e6, current_heads=5)
    with pytest.raises(ValueError, match="correlation"):
        recommend_allocation(768, 1e6, correlation=1.5)
    with pytest.raises(TypeError, match="AllocationLaw"):
        recommend_allocation(768, 1e6, law={"beta": 1})
    with pytest.raises(ValueError, match="min_head_dim"):
        recommend_allocation(768, 1e6, min_head_dim=64, max_head_dim=32)
    with pytest.raises(TypeError, match="integer"):
        recommend_allocation(768.5, 1e6)


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------


def test_fit_recovers_parameters_from_noiseless_sweep():
    fit = fit_allocation_law(_synthetic_sweep(TRUE, 0, noise=0.0))
    assert fit.converged
    assert fit.rms_log_residual < 1e-8
    for name, value in TRUE.as_dict().items():
        assert getattr(fit.law, name) == pytest.approx(value, rel=1e-5), name


@pytest.mark.parametrize("edge, value", [("sigma2", 0.0), ("rho", 1.0)])
def test_a_parameter_on_the_edge_of_its_range_is_reported(edge, value):
    law = TRUE.replace(**{edge: value})
    fit = fit_allocation_law(_synthetic_sweep(law, 0, noise=0.0))
    assert fit.rms_log_residual < 1e-6
    assert getattr(fit.law, edge) == pytest.approx(value, abs=1e-6)
    assert edge in fit.at_bound and math.isnan(fit.stderr[edge])
    assert f"{edge}={value:.4g} (at the bound of its range)" in fit.summary()
    if edge == "sigma2":
        assert fit.law.sigma2 == 0.0  # a vanished noise floor is reported as exactly 0
    others = [n for n in ("a", "alpha", "c", "beta") if n not in fit.at_bound]
    assert others == ["a", "alpha", "c", "beta"]
    for name in others:
        assert getattr(fit.law, name) == pytest.approx(getattr(law, name), rel=1e-4), name


def test_fit_residuals_are_log_prediction_errors():
    runs = _synthetic_sweep(TRUE, 1)
    fit = fit_allocation_law(runs)
    expected = np.array(
        [math.log(_hand_loss(fit.law, r.num_heads, r.head_dim, r.n_train)) - math.log(r.loss) for r in runs]
    )
    assert np.allclose(fit.residuals, expected, atol=1e-12)
    assert fit.rms_log_residual == pytest.approx(math.sqrt(np.mean(expected**2)))
    assert fit.max_abs_log_residual == pytest.approx(np.abs(expected).max())
    assert 0.02 < fit.rms_log_residual < 0.04  # the 3% noise we put in
    table = fit.residual_table(limit=5)
    assert len(table.splitlines()) == 6


def test_fit_reaches_the_scipy_least_squares_optimum():
    runs = _synthetic_sweep(TRUE, 2, noise=0.05)
    H = np.array([r.num_heads for r in runs], float)
    d = np.array([r.head_dim for r in runs], float)
    N = np.array([r.n_train for r in runs], float)
    y = np.array([r.loss for r in runs], float)

    def resid(p):
        s, a, al, c, b, rho = p
        return np.log(s + a * d**-al + c * N ** (-2 * b / (2 * b + d)) * (rho + (1 - rho) / H)) - np.log(y)

    ref = scipy.optimize.least_squares(
        resid,
        x0=list(TRUE.as_dict().values()),
        bounds=([0, 1e-9, 1e-3, 1e-9, 1e-3, 0], [10, 1e3, 20, 1e3, 1e4, 1]),
        xtol=1e-15,
        ftol=1e-15,
        gtol=1e-15,
    )
    ours = fit_allocation_law(runs)
    ref_cost = 0.5 * float(ref.fun @ ref.fun)
    our_cost = 0.5 * float(ours.residuals @ ours.residuals)
    assert our_cost <= ref_cost * (1 + 1e-6)
    assert np.allclose(list(ours.law.as_dict().values()), ref.x, rtol=1e-3)


def test_noisy_fit_recommends_the_true_split_on_held_out_budgets():
    held_out = [(D, N) for D in (96, 192, 384, 512, 768) for N in (3e3, 3e4, 3e5, 3e6)]
    checked = 0
    for seed in range(3):
        fit = fit_allocation_law(_synthetic_sweep(TRUE, seed, noise=0.03))
        assert fit.rms_log_residual < 0.05
        for D, N in held_out:
            true_rec = recommend_allocation(D, N, TRUE, min_head_dim=4)
            fit_rec = recommend_allocation(D, N, fit.law, min_head_dim=4)
            losses = sorted(o.predicted_loss for o in true_rec.table)
            margin = losses[1] / losses[0] - 1
            regret = _hand_loss(TRUE, fit_rec.num_heads, fit_rec.head_dim, N) / true_rec.predicted_loss - 1
            assert regret < 0.01, (seed, D, N)
            if margin > 0.02:  # a clear winner under the true law must be found exactly
                assert (fit_rec.num_heads, fit_rec.head_dim) == (true_rec.num_heads, true_rec.head_dim), (seed, D, N)
                checked += 1
    assert checked >= 40


def test_reported_standard_errors_match_the_spread_over_noise_draws():
    fits = [fit_allocation_law(_synthetic_sweep(TRUE, 100 + s, noise=0.03)) for s in range(24)]
    for name in ("alpha", "beta"):
        spread = np.std([math.log(getattr(f.law, name)) for f in fits], ddof=1)
        reported = np.median([f.stderr[name] for f in fits])
        assert 0.5 < reported / spread < 2.0, (name, reported, spread)


def test_fixed_parameters_and_input_checks():
    runs = _synthetic_sweep(TRUE, 3)
    fit = fit_allocation_law(runs, fixed={"sigma2": 0.05, "rho": 0.3})
    assert fit.law.sigma2 == 0.05 and fit.law.rho == 0.3
    assert "sigma2" not in fit.fitted and math.isnan(fit.stderr["sigma2"])
    assert fit.law.beta == pytest.approx(TRUE.beta, rel=0.2)
    fit2 = fit_allocation_law(runs, init=TRUE, fixed=["beta"])
    assert fit2.law.beta == TRUE.beta
    with pytest.raises(ValueError, match="unknown parameter"):
        fit_allocation_law(runs, fixed={"gamma": 1.0})
    with pytest.raises(ValueError, match="cannot determine"):
        fit_allocation_law(runs[:4])
    with pytest.raises(ValueError, match="every parameter is fixed"):
        fit_allocation_law(runs, fixed=list(TRUE.as_dict()))
    with pytest.raises(ValueError, match="empty"):
        fit_allocation_law([])


def test_measured_correlations_replace_rho_per_run():
    rng = np.random.default_rng(4)
    law = TRUE
    runs = []
    for D in (64, 128):
        for d in (4, 8, 16, 32):
            for N in (1e3, 1e4, 1e5):
                H = D // d
                corr = None if H == 1 else float(rng.uniform(0.1, 0.8))
                runs.append(AllocationRun(H, d, N, _hand_loss(law, H, d, N, rho=corr), corr))
    fit = fit_allocation_law(runs)
    assert fit.rms_log_residual < 1e-8
    for name in ("sigma2", "a", "alpha", "c", "beta"):
        assert getattr(fit.law, name) == pytest.approx(getattr(law, name), rel=1e-5)
    measured = [r.correlation for r in runs if r.correlation is not None]
    assert fit.law.rho == pytest.approx(np.mean(measured))
    assert "rho" not in fit.fitted and fit.rho_source.startswith("measured")
    with pytest.raises(ValueError, match="ensemble factor"):
        AllocationRun(4, 8, 100, 0.1, correlation=-0.5)


# --------------------------------------------------------------------------------------------
# Sweep input
# --------------------------------------------------------------------------------------------


def test_load_sweep_csv_and_records(tmp_path):
    p = tmp_path / "runs.csv"
    p.write_text("# a comment\nH,d_k,N,loss,correlation,seed,budget\n8,8,1000,0.5,0.3,0,64\n\n4,16,1e4,0.25,,1,64\n")
    runs = load_sweep_csv(p)
    assert runs == [AllocationRun(8, 8, 1000.0, 0.5, 0.3), AllocationRun(4, 16, 10000.0, 0.25, None)]
    recs = load_sweep([{"num_heads": 8, "head_dim": 8, "n_train": 1000, "loss": 0.5, "rho": 0.3}])
    assert recs == [AllocationRun(8, 8, 1000.0, 0.5, 0.3)]
    assert load_sweep(str(p)) == runs


@pytest.mark.parametrize(
    "text, match",
    [
        ("H,d_k,N\n8,8,1000\n", r"missing required column.*loss"),
        ("H,d_k,N,loss\n8,8,1000,abc\n", r"line 2: column 'loss' is 'abc', not a number"),
        ("H,d_k,N,loss\n8,8,1000,0.5\n8.5,8,1000,0.5\n", r"line 3: column 'H' is 8.5, not an integer"),
        ("H,d_k,N,loss\n8,8,1000,-1\n", r"line 2: loss must be > 0, got -1"),
        ("H,d_k,N,loss\n8,8,1000\n", r"line 2: 3 fields, but the header has 4"),
        ("H,d_k,N,loss,total_dim\n8,8,1000,0.5,128\n", r"total_dim=128 but num_heads\*head_dim=8\*8=64"),
        ("H,d_k,N,loss\n", "header only"),
        ("", "empty file"),
        ("H,heads,d_k,N,loss\n8,8,8,1000,0.5\n", "all name the field"),
        ("H,d_k,N,loss\n8,8,0.5,0.5\n", "n_train must be >= 1"),
        ("H,d_k,N,loss\n8,8,1000,nan\n", "not a finite number"),
    ],
)
def test_bad_csv_gives_a_clear_error(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_sweep_csv(p)


def test_missing_or_binary_csv(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_sweep_csv(tmp_path / "nope.csv")
    p = tmp_path / "bin.csv"
    p.write_bytes(b"\xff\xfe\x00\x81garbage")
    with pytest.raises(ValueError, match="UTF-8"):
        load_sweep_csv(p)
    with pytest.raises(TypeError, match="AllocationRun"):
        load_sweep([(8, 8, 1000, 0.5)])


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _write_sweep(path, law=TRUE, seed=0):
    runs = _synthetic_sweep(law, seed, noise=0.02)
    lines = ["H,d_k,N,loss"] + [f"{r.num_heads},{r.head_dim},{r.n_train:g},{r.loss:.8g}" for r in runs]
    path.write_text("\n".join(lines) + "\n")
    return runs


def test_cli_prints_recommendation_table_and_writes_plot(tmp_path, capsys):
    out = tmp_path / "alloc.png"
    rc = main(["allocate", "--budget", "768", "--train-size", "1e6", "--current-heads", "8", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    rec = recommend_allocation(768, 1e6, current_heads=8)
    dims = [d for d in _divisors(768) if 8 <= d <= 256]
    best = dims[int(np.argmin([_hand_loss(AllocationLaw(), 768 // d, d, 1e6) for d in dims]))]  # brute force
    assert f"Recommended: H={768 // best} heads x d_k={best}" in text
    assert rec.format_table() in text
    assert sum("<- " in line and "current" in line for line in text.splitlines()) == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # a directory gets allocation.png
    rc = main(["allocate", "--budget", "256", "--train-size", "1000", "--out", str(tmp_path)])
    assert rc == 0 and (tmp_path / "allocation.png").is_file()


_PNG = b"\x89PNG\r\n\x1a\n"


def test_cli_out_never_writes_through_a_link_nor_overwrites_without_force(tmp_path, capsys):
    """--out as report and prune treat it: a symbolic link is refused (exit 2, one line naming it,
    with or without --force, dangling too), an existing plot is replaced only with --force, and all
    of it is checked before any work (nothing printed)."""
    args = ["allocate", "--budget", "256", "--train-size", "1000"]
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    folder = tmp_path / "plots"
    folder.mkdir()
    links = {"file": tmp_path / "plot.png", "dangling": tmp_path / "gone.png", "folder": tmp_path / "linked"}
    links["file"].symlink_to(victim)
    links["dangling"].symlink_to(tmp_path / "nowhere.png")
    links["folder"].symlink_to(folder, target_is_directory=True)
    for link in links.values():
        for force in ([], ["--force"]):
            assert main([*args, "--out", str(link), *force]) == 2
            out, err = capsys.readouterr()
            assert out == ""
            assert err == (
                f"hdi-monitor allocate: error: --out {str(link)!r} is a symbolic link; give a real file or folder "
                "(links are not followed)\n"
            )
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "nowhere.png").exists() and list(folder.iterdir()) == []

    # an existing plot: refused without --force, replaced with it
    plot = tmp_path / "old.png"
    plot.write_bytes(b"old plot")
    assert main([*args, "--out", str(plot)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"hdi-monitor allocate: error: --out: {str(plot)!r} exists; pass --force to replace it, or give a new file "
        "name\n"
    )
    assert plot.read_bytes() == b"old plot"
    assert main([*args, "--out", str(plot), "--force"]) == 0
    assert plot.read_bytes()[:8] == _PNG

    # a folder: allocation.png inside it follows the same rule; a link there is replaced, not followed
    (folder / "allocation.png").symlink_to(victim)
    assert main([*args, "--out", str(folder)]) == 2
    assert capsys.readouterr().err == (
        f"hdi-monitor allocate: error: --out: {str(folder / 'allocation.png')!r} exists; pass --force to replace "
        "it, or give a new file name\n"
    )
    assert main([*args, "--out", str(folder), "--force"]) == 0
    assert victim.read_text() == "keep me"
    assert not (folder / "allocation.png").is_symlink() and (folder / "allocation.png").read_bytes()[:8] == _PNG


def test_cli_fits_a_sweep(tmp_path, capsys):
    csv_path = tmp_path / "runs.csv"
    runs = _write_sweep(csv_path)
    rc = main(["allocate", "--budget", "384", "--train-size", "3e4", "--sweep", str(csv_path), "--min-head-dim", "4"])
    assert rc == 0
    text = capsys.readouterr().out
    fit = fit_allocation_law(runs)
    rec = recommend_allocation(384, 3e4, fit.law, min_head_dim=4)
    assert f"Recommended: H={rec.num_heads} heads x d_k={rec.head_dim}" in text
    assert f"RMS log residual {fit.rms_log_residual:.4f}" in text
    assert "log_resid" in text
    rc = main(["allocate", "--budget", "384", "--train-size", "3e4", "--sweep", str(csv_path), "--fix", "sigma2=0.05"])
    assert rc == 0 and "sigma2=0.05 (fixed)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--sweep", "{bad}"], "line 3: column 'loss' is 'oops', not a number"),
        (["--sweep", "{missing}"], "does not exist"),
        (["--current-heads", "5"], "does not divide"),
        (["--fix", "beta=2"], "--fix only applies"),
        (["--sweep", "{good}", "--fix", "gamma=2"], "unknown parameter"),
        (["--out", "{dir}/plot.txt"], "unsupported plot format"),
        (["--out", "{dir}/no/such/dir/plot.png"], "does not exist"),
        (["--min-head-dim", "200", "--max-head-dim", "250"], "no divisor"),
        (["--correlation", "2"], "correlation must be in"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, extra, match):
    bad = tmp_path / "bad.csv"
    bad.write_text("H,d_k,N,loss\n8,8,1000,0.5\n4,16,1000,oops\n")
    good = tmp_path / "good.csv"
    _write_sweep(good)
    fmt = {"bad": bad, "missing": tmp_path / "missing.csv", "good": good, "dir": tmp_path}
    extra = [e.format(**fmt) for e in extra]
    rc = main(["allocate", "--budget", "768", "--train-size", "1e6", *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("hdi-monitor allocate: error:") and match in err
    assert len(err.strip().splitlines()) == 1


def test_cli_argument_errors_exit_2():
    assert main(["allocate", "--train-size", "100"]) == 2  # --budget is optional with --runs: checked in run()
    for argv in (
        ["allocate", "--budget", "0", "--train-size", "100"],
        ["allocate", "--budget", "64", "--train-size", "abc"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2


@pytest.mark.slow
def test_cli_subprocess_bad_csv_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("H,d_k,N\n8,8,1000\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hdi_monitor.cli",
            "allocate",
            "--budget",
            "64",
            "--train-size",
            "1000",
            "--sweep",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "missing required column" in proc.stderr and str(bad) in proc.stderr


@pytest.mark.slow
def test_example_quick_run_writes_its_outputs(tmp_path):
    """Smoke run of examples/allocation_sweep.py (tiny N, one seed): it trains, fits and writes files."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "allocation_sweep.py"
    spec = importlib.util.spec_from_file_location("allocation_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--quick", "--threads", "1", "--out", str(tmp_path)])
    runs = load_sweep_csv(tmp_path / "sweep.csv")
    assert len(runs) == 15 and all(r.num_heads * r.head_dim == 16 for r in runs)
    assert (tmp_path / "allocation.png").read_bytes()[:4] == b"\x89PNG"
    report = (tmp_path / "allocation.md").read_text()
    assert "What it shows" in report
    # the MSE table's "best d_k" is the argmin of the losses the script wrote to sweep.csv
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in report.splitlines()
        if re.match(r"\| \d+ \| .*\*\*", line)
    ]
    assert len(rows) == 3
    for cells in rows:
        n = float(cells[0])
        best = min((r for r in runs if r.n_train == n), key=lambda r: r.loss)
        assert int(cells[6]) == best.head_dim, cells
        assert f"**{best.loss:.4f}**" in cells[1:6]
