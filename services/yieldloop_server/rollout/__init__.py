"""RolloutService: the policy engine, generation, rollouts and hot reload of the head."""
