//! Signals, drain and sd_notify.
