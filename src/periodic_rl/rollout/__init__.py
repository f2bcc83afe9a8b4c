"""The rollout side: engines, workers, the pipeline that generates every iteration, pushes."""
