"""Moving frames over sockets. Knows nothing of roles; the protocol layer says what the bytes mean."""
