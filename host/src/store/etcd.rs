//! etcd store: placeholder until the etcd client lands.
