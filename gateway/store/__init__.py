"""The store process (it owns the store file), the gateway's link to it, and the capture plan."""
