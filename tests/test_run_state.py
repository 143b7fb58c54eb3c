"""train.py's loop state (denoised_gpt.training.RunState) on its own: what a resumed run starts from, when an
iteration evaluates, what an evaluation and a non-finite step change. The loop itself is run end to end by
test_train.py, test_divergence.py, test_stop_at_val_loss.py and the resume tests."""
import math

from denoised_gpt.training import RunState


def test_a_resumed_run_starts_from_its_checkpoint_which_is_on_disk():
    run = RunState.resumed({'iter_num': 40, 'best_val_loss': 2.5, 'best_iter': 20, 'val_loss': 2.7,
                            'train_time': 12.0}, eval_interval=20)
    assert (run.iter_num, run.best_val_loss, run.best_iter, run.train_time) == (40, 2.5, 20, 12.0)
    assert (run.saved_iter, run.saved_val_loss, run.evaluation_owed) == (40, 2.7, False)
    # a NaN best beats nothing: no best yet; an older checkpoint (no best_iter, no val_loss, no time) owes nothing
    run = RunState.resumed({'iter_num': 40, 'best_val_loss': math.nan}, eval_interval=20)
    assert (run.best_val_loss, run.best_iter, run.train_time, run.evaluation_owed) == (1e9, None, 0.0, False)


def test_a_state_saved_unevaluated_at_an_evaluation_is_evaluated_once_after_the_resume():
    owed = RunState.resumed({'iter_num': 40, 'best_val_loss': 2.5, 'val_loss': None}, eval_interval=20)
    assert owed.evaluation_owed
    assert owed.evaluates(done=False, eval_interval=20, eval_only=False)
    assert not owed.evaluates(done=False, eval_interval=20, eval_only=False)  # owed once
    between = RunState.resumed({'iter_num': 45, 'best_val_loss': 2.5, 'val_loss': None}, eval_interval=20)
    assert not between.evaluation_owed and not between.evaluates(done=False, eval_interval=20, eval_only=False)
    assert between.evaluates(done=True, eval_interval=20, eval_only=True)  # eval_only evaluates what is on disk
    assert not between.evaluates(done=True, eval_interval=20, eval_only=False)  # a resume with nothing to train


def test_an_iteration_evaluates_at_the_interval_and_at_the_end_but_not_while_stopping():
    run = RunState(iter_num=30)
    assert not run.evaluates(done=False, eval_interval=20, eval_only=False)
    assert run.evaluates(done=True, eval_interval=20, eval_only=False)
    run.iter_num = 40
    assert run.evaluates(done=False, eval_interval=20, eval_only=False)
    run.stopping = True
    assert not run.evaluates(done=True, eval_interval=20, eval_only=False)


def test_an_evaluation_sets_the_best_and_a_non_finite_one_makes_the_state_unsaveable():
    run = RunState(iter_num=20)
    run.record_evaluation({'train': 2.0, 'val': 2.1}, stop_at_val_loss=0.0, eval_only=False)
    assert (run.val_loss, run.improved, run.best_val_loss, run.best_iter, run.unsaveable) == (2.1, True, 2.1, 20, None)
    run.iter_num = 40
    run.record_evaluation({'train': 1.0, 'val': math.nan}, stop_at_val_loss=0.0, eval_only=False)
    assert not run.improved and (run.best_val_loss, run.best_iter) == (2.1, 20)
    assert run.unsaveable.startswith("its evaluation is not finite (train loss 1.0, val loss nan")
    run.record_evaluation({'train': 1.0, 'val': 0.5}, stop_at_val_loss=0.5, eval_only=True)
    assert not run.target_reached  # eval_only trains nothing: no target to reach
    run.record_evaluation({'train': 1.0, 'val': 0.5}, stop_at_val_loss=0.5, eval_only=False)
    assert run.target_reached and (run.best_val_loss, run.best_iter) == (0.5, 40)


def test_a_saved_state_is_the_one_on_disk_and_a_refused_one_is_not():
    run = RunState(iter_num=20, val_loss=2.0)
    run.record_save("its weights are not all finite")
    assert (run.saved_iter, run.refusal) == (None, "its weights are not all finite")
    run.record_save(None)
    assert (run.saved_iter, run.saved_val_loss, run.refusal) == (20, 2.0, None)


def test_non_finite_steps_are_skipped_until_max_skipped_steps_in_a_row_and_a_finite_one_resets_the_count():
    run = RunState(iter_num=7, local_iter_num=3, saved_iter=5)
    args = dict(ce_mean=math.nan, kl_mean=0.0, kl_weight=0.0, nonfinite='skip', max_skipped_steps=2,
                out_dir='out', settings={'learning_rate': 1e-3})
    assert run.skip_nonfinite_step(**args) is None
    assert run.unsaveable == "its last step (iter 7) had a non-finite loss or gradient"
    run.next_iteration(finite_step=True, stop_requested=False)
    assert (run.iter_num, run.local_iter_num, run.skipped_in_a_row, run.unsaveable) == (8, 4, 0, None)
    assert run.skip_nonfinite_step(**args) is None
    run.next_iteration(finite_step=False, stop_requested=False)
    why = run.skip_nonfinite_step(**args)
    assert why.startswith("stopping at iter 9: 2 steps in a row had a non-finite loss or gradient "
                          "(max_skipped_steps=2): the run has diverged")
    assert RunState().skip_nonfinite_step(**{**args, 'nonfinite': 'stop'}).endswith(
        "or set --nonfinite=skip to skip such steps.")


def test_a_stop_request_is_kept_and_a_new_state_is_not_evaluated():
    run = RunState(iter_num=3, val_loss=2.0, improved=True)
    run.next_iteration(finite_step=True, stop_requested=True)
    assert (run.iter_num, run.val_loss, run.improved, run.stopping) == (4, None, False, True)
    run.next_iteration(finite_step=True, stop_requested=False)
    assert run.stopping
