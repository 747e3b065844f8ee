"""Pipeline parallelism: stage split, schedules, executor."""
