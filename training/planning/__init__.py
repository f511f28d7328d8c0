"""The planner: what a layout's step needs in memory, FLOPs, bytes on the wire and time, at any
world size, found by executing the project's own step on meta tensors under a fake process
group (``rank_plan``: one rank; ``layout_plan``: the ranks that matter, over a step's
micro-batches; ``step_account``: the counting, the same for a real step; ``step_time``: the
step's time bound on H100s). Not the run's own plan (``training.run_plan.RunPlan``: its split,
micro-batches and resume), which every run works out before it builds anything."""
