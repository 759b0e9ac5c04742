//! Serde forms of the SDK's plain types (the SDK stays free of
//! dependencies for guests), and of the node's per-kind counters.

/// `Option<TaskClass>` as its contract name (`"training"`, ...).
pub mod opt_task_class {
    use berth_sdk::TaskClass;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(class: &Option<TaskClass>, s: S) -> Result<S::Ok, S::Error> {
        class.map(TaskClass::name).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<TaskClass>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(name) => TaskClass::from_name(&name).map(Some).ok_or_else(|| serde::de::Error::custom(format!("unknown task class {name:?}"))),
        }
    }
}

/// `Tier` as its name (`"guaranteed"`, ...).
pub mod tier {
    use berth_sdk::Tier;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(tier: &Tier, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(tier.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Tier, D::Error> {
        let name = String::deserialize(d)?;
        Tier::from_name(&name).ok_or_else(|| serde::de::Error::custom(format!("unknown tier {name:?}")))
    }
}

/// A node's 64 per-kind counters as `[kind, count]` pairs of the non-zero
/// ones: most nodes hold one or two kinds.
pub mod sparse_counts {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(counts: &[u32; 64], s: S) -> Result<S::Ok, S::Error> {
        let pairs: Vec<(u8, u32)> = counts.iter().enumerate().filter(|&(_, &c)| c > 0).map(|(k, &c)| (k as u8, c)).collect();
        pairs.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u32; 64], D::Error> {
        let mut counts = [0u32; 64];
        for (k, c) in Vec::<(u8, u32)>::deserialize(d)? {
            *counts.get_mut(usize::from(k)).ok_or_else(|| serde::de::Error::custom(format!("kind {k} out of 0..64")))? = c;
        }
        Ok(counts)
    }
}
