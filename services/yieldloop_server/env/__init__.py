"""EnvService: environments, scenarios and isolated episodes."""
