//! The embedded store: one redb file (ACID, crash-safe: a commit is on disk
//! before `apply` returns, so a kill -9 loses nothing acknowledged).

use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, TableDefinition};

use super::{Op, Store, StoreError};

const KV: TableDefinition<&str, &[u8]> = TableDefinition::new("berth");

pub struct RedbStore {
    db: Database,
    path: PathBuf,
}

fn err(path: &Path) -> impl Fn(&dyn std::fmt::Display) -> StoreError + '_ {
    move |e| StoreError::Backend(format!("{}: {e}", path.display()))
}

impl RedbStore {
    /// Opens (or creates) the database file. Another process holding it
    /// open is an error naming the file.
    pub fn open(path: &Path) -> Result<RedbStore, StoreError> {
        let e = err(path);
        let db = Database::create(path).map_err(|x| e(&x))?;
        // Create the table so reads of an empty store find it.
        let tx = db.begin_write().map_err(|x| e(&x))?;
        tx.open_table(KV).map_err(|x| e(&x))?;
        tx.commit().map_err(|x| e(&x))?;
        Ok(RedbStore { db, path: path.to_path_buf() })
    }
}

impl Store for RedbStore {
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let e = err(&self.path);
        let tx = self.db.begin_read().map_err(|x| e(&x))?;
        let table = tx.open_table(KV).map_err(|x| e(&x))?;
        let mut out = Vec::new();
        for row in table.range(prefix..).map_err(|x| e(&x))? {
            let (k, v) = row.map_err(|x| e(&x))?;
            if !k.value().starts_with(prefix) {
                break;
            }
            out.push((k.value().to_string(), v.value().to_vec()));
        }
        Ok(out)
    }

    fn apply(&self, ops: Vec<Op>) -> Result<(), StoreError> {
        let e = err(&self.path);
        let tx = self.db.begin_write().map_err(|x| e(&x))?;
        {
            let mut table = tx.open_table(KV).map_err(|x| e(&x))?;
            for op in &ops {
                match op {
                    Op::Put(k, v) => drop(table.insert(k.as_str(), v.as_slice()).map_err(|x| e(&x))?),
                    Op::Delete(k) => drop(table.remove(k.as_str()).map_err(|x| e(&x))?),
                }
            }
        }
        tx.commit().map_err(|x| e(&x))
    }

    fn describe(&self) -> String {
        format!("redb {}", self.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puts_deletes_and_prefix_lists_survive_reopening() {
        let dir = std::env::temp_dir().join(format!("berth-redb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.redb");
        {
            let s = RedbStore::open(&path).unwrap();
            s.apply(vec![Op::Put("jobs/p0/1".into(), b"a".to_vec()), Op::Put("jobs/p0/2".into(), b"b".to_vec()), Op::Put("jobsx".into(), b"c".to_vec())]).unwrap();
            s.apply(vec![Op::Delete("jobs/p0/1".into()), Op::Put("nodes/n1".into(), b"d".to_vec())]).unwrap();
        }
        let s = RedbStore::open(&path).unwrap();
        assert_eq!(s.list("jobs/").unwrap(), vec![("jobs/p0/2".to_string(), b"b".to_vec())]);
        assert_eq!(s.get("nodes/n1").unwrap(), Some(b"d".to_vec()));
        assert_eq!(s.get("nodes/n").unwrap(), None);
        // A second open of the same file while this one holds it names the file.
        let e = RedbStore::open(&path).err().expect("the file is held");
        assert!(e.to_string().contains("state.redb"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
