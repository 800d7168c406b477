//! Switch file.
