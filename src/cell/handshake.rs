//! Startup handshake.
