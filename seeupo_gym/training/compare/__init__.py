"""`seeupo-compare`: several algorithms on the same env, model, seeds and budget, side by side.

Every (algorithm, seed) run trains from the same config with only `algorithm` and
`train.seed` changed, so the runs see the same tasks in the same order and start from the
same weights; `--match steps` also gives every method as many optimizer steps per batch as the
method taking the most (`match.py`). Each run is evaluated before training and every `--eval-every` steps on the
same eval tasks with k rollouts per task (avg@k, unbiased pass@k; see `seeupo-eval`). The
run folder then holds:

    report.md      the final table (best per column in bold), eval scores by step, settings
    curves.png     training reward and eval avg@k versus step, mean and spread over seeds
    metrics.jsonl  every record of every run, tagged with algorithm and seed
    summary.json   the numbers of the final table
    run.json       the command, the resolved settings, the eval task ids, failures
    <label>/seed-<s>/   each run's own folder (config.yaml, metrics.jsonl, checkpoints/)

Runs are sequential in one process (use `seeupo-train` under `accelerate launch` to spread
one run over devices). One module per job:

    plan.py    parse and check everything (RunSpec, ComparePlan) before any run starts
    match.py   the budget held equal: samples, or optimizer steps (StepMatched raises epochs)
    run.py     drive each run through `Trainer.train(on_step=...)` and evaluate at the planned steps
    stats.py   metric series over steps and seeds, the final-table rows
    report.py  report.md (tables and prose) and summary.json
    plots.py   curves.png
    cli.py     `seeupo-compare` (`main`)
"""
