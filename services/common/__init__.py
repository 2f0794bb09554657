"""Parts every service process shares: the gRPC server shell, error translation, logging."""
