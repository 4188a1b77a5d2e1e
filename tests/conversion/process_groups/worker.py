"""One rank of a multi-process conversion for the tests (launched by ``launch.py``): builds the
tiny LLaMA and batches of ``scenario.py``, converts under an initialised gloo group, and rank 0
saves the converted state dict and report to ``OUT``."""
from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenario import batches, counting_fits, logits_score, tiny_llama  # noqa: E402


def _die_at_barrier(named: str) -> None:
    """This rank exits abruptly (no cleanup) when it reaches the barrier whose name holds ``named``."""
    from panther_lite.conversion.process_groups.group import ProcessGroupRun

    original = ProcessGroupRun.barrier

    def dying(self, what):
        if named in what:
            os._exit(3)
        return original(self, what)

    ProcessGroupRun.barrier = dying


def _die_at_second_exchange() -> None:
    """This rank exits abruptly (no cleanup) when it reaches its second exchange of statistics."""
    from panther_lite.conversion.process_groups.group import ProcessGroupRun

    original, calls = ProcessGroupRun.sum_in_rank_order, []

    def dying(self, tensors, what):
        calls.append(what)
        if len(calls) == 2:
            os._exit(3)
        return original(self, tensors, what)

    ProcessGroupRun.sum_in_rank_order = dying


def _fail_in(where: str) -> None:
    """This rank raises (an ordinary exception, its process living on) mid-run: in the streamed gains
    pass ("gains"), in rank 0's commit of block 1 ("commit"), or writing its hidden states after
    block 0 ("shard")."""
    from panther_lite.conversion.pipelines import out_of_core
    from panther_lite.conversion.process_groups import run_state
    from panther_lite.conversion.saving.resume_state import RunState

    def gains(*args, **kwargs):
        raise RuntimeError("injected failure in the gains pass")

    def failing(original, at: int):
        def call(self_or_root, finished, *args, **kwargs):
            if finished == at:
                raise OSError(28, "injected: No space left on device")
            return original(self_or_root, finished, *args, **kwargs)

        return call

    if where == "gains":
        out_of_core.streamed_block_gains = gains
    elif where == "commit":
        RunState.commit = failing(RunState.commit, 2)
    else:
        run_state.save_shard = failing(run_state.save_shard, 1)


def _refusals() -> dict:
    """Each option not distributed yet, tried: ``{case: "ErrorType: message"}`` (or "ran")."""
    import panther_lite

    cases = {
        "callable": lambda: panther_lite.convert(tiny_llama(), calibration_data=lambda m: m(batches(1)[0]["input_ids"]),
                                                 param_ratio=0.5),
        "odd batches": lambda: panther_lite.convert(tiny_llama(), calibration_data=batches(4, size=3), param_ratio=0.5),
        "one batch": lambda: panther_lite.convert(tiny_llama(), calibration_data=batches(1), param_ratio=0.5),
        "output Fisher": lambda: panther_lite.convert(tiny_llama(), calibration_data=batches(2), param_ratio=0.5,
                                                      output_fisher=True),
    }
    found = {}
    for name, case in cases.items():
        try:
            case()
            found[name] = "ran"
        except Exception as error:  # noqa: BLE001 - the test reads each error
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _refine_setups() -> dict:
    """``refine_block`` across the processes with a wrong setup, each case tried:
    ``{case: "ErrorType: message"}`` (or "ran")."""
    from panther_lite.conversion.fitting.refinement import refine_block
    from panther_lite.conversion.process_groups.group import ProcessGroupRun, running_on

    rank, found = dist.get_rank(), {}
    cases = {"uneven calls": ([1, 3][rank], 4), "other parameters": (2, [4, 5][rank])}
    for name, (calls, width) in cases.items():
        weight = torch.nn.Parameter(torch.ones(width))
        targets = [torch.full((width,), 2.0) for _ in range(calls)]
        try:
            with running_on(ProcessGroupRun()):
                refine_block([weight], lambda i: weight * 1.0, targets, max_steps=2, progress=False)
            found[name] = "ran"
        except Exception as error:  # noqa: BLE001 - the test reads each error
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _distill(options: dict) -> dict:
    """The tiny LLaMA converted in each process alone (a group of one), then distilled across all of
    them against the live original or its outputs cached across them: the state dict and result."""
    import copy

    import panther_lite

    alone = [dist.new_group(ranks=[rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
    teacher = tiny_llama()
    model = copy.deepcopy(teacher)
    data = batches(options.pop("batches", 4))
    panther_lite.convert(model, calibration_data=data, param_ratio=0.3, progress=False, process_group=alone)
    if options.pop("cached", False):
        teacher = panther_lite.teacher_outputs(teacher, data, top_k=8, progress=False)
    result = panther_lite.distill(model, teacher, data, progress=False, **options)
    return {"state": model.state_dict(), "history": result.history, "steps": result.steps,
            "best_step": result.best_step}


def main() -> None:
    options, out = json.loads(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=float(os.environ.get("TEST_COLLECTIVE_TIMEOUT", "120")))
    backend = os.environ.get("TEST_BACKEND", "gloo")
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timeout)
    rank = dist.get_rank()
    if os.environ.get("TEST_FAIL_RANK") == str(rank):
        _fail_in(os.environ["TEST_FAIL_IN"])
    if os.environ.get("TEST_DIE_RANK") == str(rank):
        if os.environ.get("TEST_DIE_AT"):
            _die_at_barrier(os.environ["TEST_DIE_AT"])
        else:
            _die_at_second_exchange()
    mode = options.pop("mode", "convert")
    if mode == "convert":
        import panther_lite

        model = tiny_llama(options.pop("model", "llama"))
        if options.pop("explicit_group", False):  # a group of its own, not the default one
            options["process_group"] = dist.new_group(ranks=list(range(dist.get_world_size())))
        report = panther_lite.convert(model, calibration_data=batches(options.pop("batches", 4)), progress=False, **options)
        if rank == 0:
            torch.save({"state": model.state_dict(), "rows": report["calibration_rows"].fillna(-1).astype(int).tolist(),
                        "refinement": report.attrs.get("refinement")}, out)
    elif mode == "count fits":  # every rank saves its model and the layers it fitted
        import panther_lite

        model, built = tiny_llama(options.pop("model", "llama")), []
        with counting_fits(model, built):
            report = panther_lite.convert(model, calibration_data=batches(options.pop("batches", 4)), progress=False,
                                          **options)
        rows = report["calibration_rows"].fillna(-1).astype(int).tolist()
        torch.save({"state": model.state_dict(), "built": built, "rows": rows}, f"{out}.{rank}")
    elif mode == "distill":
        found = _distill(options)
        if rank == 0:
            torch.save(found, out)
    elif mode in ("refusals", "refine setups"):
        found = _refusals() if mode == "refusals" else _refine_setups()
        if rank == 0:
            torch.save(found, out)
    elif mode == "tune":  # rank 0's score decides: the others' evaluate returns nonsense
        import panther_lite

        model = tiny_llama()
        score = logits_score(model)
        report = panther_lite.tune(model, score if rank == 0 else lambda m: -1e9, calibration_data=batches(),
                                   progress=False, **options)
        if rank == 0:
            torch.save({"state": model.state_dict(), "rows": report["calibration_rows"].fillna(-1).astype(int).tolist(),
                        "search": report.attrs["search"]["budget"].tolist()}, out)
    else:  # compress: options["source"] a checkpoint directory, OUT the output directory
        import panther_lite

        source = options.pop("source")
        panther_lite.compress_checkpoint(source, out, calibration_data=batches(options.pop("batches", 4)),
                                         progress=False, **options)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it (a rank aborted at exit in CI once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
