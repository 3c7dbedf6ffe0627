"""`clawrl eval`: measure that the whole loop learns, driving a real stack (`clawrl up`) with
simulated users. Imports the base, the proxy's admin, the command's stack, the tiny world and
the environments; nothing in the product imports it."""
