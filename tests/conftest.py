"""Shared test configuration: hypothesis profiles and a printed seed, the ``slow`` marker, and the
fixtures that several test modules use."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" (default): bounded and reproducible, the seed is printed on failure.
# HYPOTHESIS_PROFILE=dev runs more examples.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


#: The tests marked ``slow``, by why: a test file of tests/, one test of it (``file::name``, all its
#: parametrisations) or one parametrisation (``file::name[id]``). ``python -m pytest -m "not slow"``
#: (the quick edit-test loop) leaves them out; ``python -m pytest`` (CI) and a file named on the
#: command line run them. Measured on a busy 2-core machine (``--durations``), every other test takes
#: under 2.5 s, its parametrisations together under 3 s.
SLOW_BY_REASON: dict[str, tuple[str, ...]] = {
    "spawns gloo process groups": (
        "distributed/test_distributed.py",
        "distributed/test_distributed_hardening.py",
        "recovery/test_spike_distributed.py",
        "distributed/test_qk_clip_distributed.py",
        "recovery/test_rewind_fsdp.py",
        "recovery/test_rerun.py::test_two_gloo_ranks_rerun_together_and_name_the_faulty_rank",
        "replay/test_replay.py::test_ddp_rank_files_replay_without_a_process_group",
        "window/test_window_guard.py::test_ddp_gradients_and_bucket_views_are_not_mistaken_for_clearing",
        "window/test_update_clip.py::test_ddp_and_fsdp2_bound_the_update_as_one_process_does",
        "window/test_update_clip.py::test_fsdp2_puts_back_a_nonfinite_update_on_every_rank",
        "window/test_update_clip.py::test_an_update_rejected_on_one_rank_is_rejected_on_every_rank",
        "window/test_update_clip.py::test_ranks_with_another_update_clip_are_refused_on_every_rank",
        "window/test_update_clip.py::test_pipeline_stages_bound_and_put_back_their_update_as_one",
        "window/test_norm_overflow.py::test_ddp_and_fsdp2_clip_a_window_whose_float32_norm_overflows",
        "window/test_norm_overflow.py::test_pipeline_stages_clip_a_window_whose_float32_norm_overflows",
        "window/test_reasons.py::test_every_reason_reads_back_as_itself_through_every_logger[divergence]",
        "policies/test_policy_fsdp.py",
        "optimizer/test_multi_optimizer.py::test_ddp_and_fsdp2_over_several_inner_optimizers_equal_one_process",
        "optimizer/test_savers.py::test_fsdp2_resume_through_the_helpers_keeps_each_ranks_rewind_copies",
    ),
    "real Lightning, Hugging Face Trainer and Accelerate runs": (
        "integrations/test_integrations_accelerate.py",
        "integrations/test_integrations_hf.py",
        "integrations/test_integrations_lightning.py",
        "report/test_report_formats.py::test_trainer_state_json",
        "report/test_report_formats.py::test_trainer_state_logged_every_few_updates_counts_rows",
        "report/test_report_formats.py::test_lightning_metrics_csv",
        "report/test_report_formats.py::test_lightning_nonfinite_gradient_names_its_layer",
        "report/test_report_formats.py::test_lightning_tensorboard_logger",
        "recovery/test_rewind_escalation.py::test_lr_cut_under_lightning_keeps_the_schedulers_values",
        "recovery/test_rewind_escalation.py::test_lr_cut_under_the_hf_trainer_keeps_the_schedulers_values",
    ),
    "real Composer Trainer runs, each in a process of its own (importing Composer alone takes 20 s)": (
        "optimizer/test_savers.py::test_composer_trainer_resumes_bit_identically",
    ),
    "imports heavyball (5-12 s: it loads torch's compiler)": (
        "optimizer/test_third_party.py::test_heavyball_optimizers_resume_bit_identically",
        "optimizer/test_third_party.py::test_corrupt_heavyball_state_dicts_are_still_refused_untouched",
        "optimizer/test_third_party.py::test_heavyball_under_accelerate_prepares_and_trains_as_without_it",
    ),
    "trains the demo's and the report's corpus of runs (minutes)": (
        "report/test_demo.py",
        "report/test_report_corpus.py",
        "report/test_report_rates.py",
        "report/test_report_advice.py",
        "report/test_report_attention.py",
    ),
    "runs benchmarks/stability's --quick smoke run twice (~10 s of CPU; CI's budget for it is 60 s)": (
        "project/test_bench_stability.py::test_quick_run_writes_results_plot_and_page",
    ),
    "runs a Python process (demo, CLI, logger at exit, pytest) or the documentation's examples": (
        "diagnostics/test_hostile_files.py::test_writer_killed_at_random_moments_leaves_every_file_usable",
        "diagnostics/test_hostile_files.py::test_csv_rows_that_cannot_be_written_at_exit_are_reported_lost",
        "project/test_cli.py::test_demo_runs_on_the_stated_threads_and_restores_them",
        "project/test_cli.py::test_demo_shows_progress_on_a_terminal",
        "project/test_cli.py::test_demo_shows_no_progress_off_a_terminal",
        "project/test_cli.py::test_no_numpy_warning_without_numpy",
        "replay/test_cli_inspect.py::test_python_m_clipopt_inspect",
        "replay/test_cli_replay.py::test_replay_as_a_subprocess",
        "diagnostics/test_diagnostics.py::test_csv_writes_at_exit",
        "diagnostics/test_diagnostics.py::test_unpickled_csv_logger_writes_at_exit",
        "diagnostics/test_diagnostics.py::test_logger_copied_in_the_same_process_writes_no_row_twice",
        "diagnostics/test_diagnostics.py::test_logger_copy_used_in_the_same_process_writes_its_own_rows_at_exit",
        "project/test_docs.py::test_page_examples_run",
        "project/test_docs.py::test_quiet_run_prints_the_hypothesis_seed",
        "diagnostics/test_tensorboard.py::test_import_clipopt_without_tensorboard",
        "diagnostics/test_diagnostics.py::test_layer_stats_after_clipopt_was_imported_under_another_default_device",
    ),
    "over 2.5 s a test (or its parametrisations together)": (
        "window/test_compile.py",
        "optimizer/test_checkpoint.py::test_resume_any_cut_then_flush",
        "diagnostics/test_diagnostics.py::test_kernels_are_accurate_on_long_tensors",
        "report/test_report_formats.py::test_tensorboard_gradscaler_overflows_are_not_nonfinite",
        "report/test_report_hostile.py::test_huge_file_is_streamed",
        "recovery/test_spike_recovery.py::test_rewind_restores_module_buffers_bit_identically",
        "recovery/test_spike_recovery.py::test_rewind_restores_module_buffers_under_accumulation",
        "recovery/test_spike_recovery.py::test_checkpoint_between_a_close_and_its_check_resumes_exactly",
        "recovery/test_spike_recovery.py::test_a_copy_of_a_wrapper_with_guard_and_rewind_recovers_on_its_own",
        "recovery/test_spike_recovery.py::test_rewind_restores_batch_norm_statistics_of_the_copy_window",
        "optimizer/test_checkpoint.py::test_resume_is_bit_identical",
        "recovery/test_rewind.py::test_capture_restore_is_bit_identical",
        "recovery/test_rewind.py::test_spikes_back_soon_after_a_rewind_go_to_an_older_copy",
        "window/test_accumulation.py::test_mean_accumulation_equals_large_batch",
        "window/test_skip.py::test_skipped_first_update_then_training_matches_reference",
    ),
}
SLOW = frozenset(entry for entries in SLOW_BY_REASON.values() for entry in entries)

#: The tests marked ``rounding``, written as :data:`SLOW`'s entries: they compare clipopt's numbers
#: with an independent computation (torch's ``clip_grad_norm_``, ``pytorch_optimizer``, NumPy)
#: exactly, where both sides run the same kernels in the same order, or within a bound derived from
#: float analysis.  A CPU's vector width changes how a reduction rounds, so ``.ci/run`` runs them
#: again under ``ATEN_CPU_CAPABILITY=default`` and ``avx2`` (#33): an assertion that holds on one
#: machine only fails in CI, not on a user's machine.  ``python -m pytest -m rounding`` runs them.
ROUNDING = frozenset(
    (
        "window/test_rounding.py",
        "window/test_norm_overflow.py",
        "policies/test_per_tensor_policies.py::test_the_policy_reproduces_the_reference_trajectory",
        "policies/test_per_tensor_policies.py::"
        "test_with_accumulation_the_policy_reproduces_the_reference_on_the_mean_gradient",
        "policies/test_per_tensor_policies.py::"
        "test_with_an_excluded_group_the_policy_matches_the_reference_on_the_others",
        "policies/test_per_tensor_policies.py::test_statistics_follow_their_tensors_through_add_param_group",
        "policies/test_policy_adagc.py::test_adagc_non_default_settings_reproduce_the_reference",
        "policies/test_policy_stable_spam.py::test_stable_spam_non_default_settings_reproduce_the_reference",
        "optimizer/test_multi_optimizer.py::test_equals_clip_grad_norm_over_all_parameters_then_each_step",
        "optimizer/test_multi_optimizer.py::test_every_norm_type_and_clip_value_over_all_parameters",
        "optimizer/test_functional.py::test_total_norm_matches_torch",
        "optimizer/test_functional.py::test_norm_clipping_matches_clip_grad_norm",
        "optimizer/test_functional.py::test_value_clipping_bounds_and_matches_torch",
        "window/test_accumulation.py::test_last_stats_fields_against_plain_torch",
    )
)

_HERE = Path(__file__).parent


def _defined(entry: str) -> bool:
    """Whether a :data:`SLOW` entry names an existing test file (and a test function in it, and the
    id of one of its parametrisations written in it)."""
    name, _, test = entry.partition("::")
    test, _, param = test.partition("[")
    path = _HERE / name
    if not path.is_file():
        return False
    text = path.read_text()
    if test and re.search(rf"^def {re.escape(test)}\(", text, re.MULTILINE) is None:
        return False
    return not param or f'"{param.removesuffix("]")}"' in text


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests listed in :data:`SLOW` with ``slow`` and those in :data:`ROUNDING` with
    ``rounding``; fail on an entry that names no test (a renamed file or test would otherwise move
    back into the quick loop, or out of CI's runs under other CPU capabilities, unnoticed)."""
    for label, entries in (("SLOW", SLOW), ("ROUNDING", ROUNDING)):
        missing = [entry for entry in entries if not _defined(entry)]
        if missing:
            raise pytest.UsageError(f"tests/conftest.py: {label} names tests that do not exist: {missing}")
    for item in items:
        file = item.path.relative_to(_HERE).as_posix() if item.path.is_relative_to(_HERE) else ""
        name = getattr(item, "originalname", item.name)
        for entries, marker in ((SLOW, pytest.mark.slow), (ROUNDING, pytest.mark.rounding)):
            if file in entries or f"{file}::{name}" in entries or f"{file}::{item.name}" in entries:
                item.add_marker(marker)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "not slow"`` a test file that is slow as a whole is not even imported: importing
    Lightning or transformers alone takes seconds of the quick loop."""
    relative = collection_path.relative_to(_HERE).as_posix() if collection_path.is_relative_to(_HERE) else ""
    if config.option.markexpr.strip() == "not slow" and relative in SLOW:
        return True
    return None


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide state (the accelerator, the gradient accumulation plugin) that
    an ``Accelerator`` or a Hugging Face ``Trainer`` sets up: reset it around each test that uses
    this fixture, so that none leaks into the next."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def pytest_configure(config: pytest.Config) -> None:
    """Pick (and later print) a hypothesis seed so every failure can be replayed."""
    if getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = int(os.environ.get("HYPOTHESIS_SEED", random.randrange(2**32)))


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.option.hypothesis_seed
    return (
        f"torch {torch.__version__}; hypothesis profile {settings._current_profile}; "
        f"seed {seed} (replay: python -m pytest --hypothesis-seed={seed})"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the seed at the end of every run too: the header is not shown with ``-q``."""
    seed = terminalreporter.config.option.hypothesis_seed
    terminalreporter.write_line(f"hypothesis seed {seed} (replay: python -m pytest --hypothesis-seed={seed})")
