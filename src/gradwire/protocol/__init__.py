"""The wire protocol as pure data: frames, dtypes, control messages and the handshake. No I/O here."""
