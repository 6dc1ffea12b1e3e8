//! Databases for audit tests: a fresh SQLite file, or a fresh PostgreSQL database per test.

use sqlx::AnyPool;

pub struct TestDb {
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    drop_pg: Option<(String, String)>,
}

impl TestDb {
    pub fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("audit.db").display());
        TestDb {
            url,
            _dir: Some(dir),
            drop_pg: None,
        }
    }

    /// A new database on the server of `RCFARM_TEST_POSTGRES_URL`, or `None` (and a loud
    /// SKIPPED line) when it is not set.
    pub async fn postgres(test: &str) -> Option<TestDb> {
        let Ok(base) = std::env::var("RCFARM_TEST_POSTGRES_URL") else {
            eprintln!(
                "SKIPPED {test} on PostgreSQL: RCFARM_TEST_POSTGRES_URL is not set (e.g. postgres://postgres@127.0.0.1:5432/test)"
            );
            return None;
        };
        sqlx::any::install_default_drivers();
        let admin = AnyPool::connect(&base)
            .await
            .unwrap_or_else(|e| panic!("RCFARM_TEST_POSTGRES_URL={base}: {e}"));
        let name = format!("rcfarm_t_{}", uuid::Uuid::new_v4().simple());
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        let (prefix, _) = base
            .rsplit_once('/')
            .expect("a database URL ends with /DBNAME");
        let url = format!("{prefix}/{name}");
        Some(TestDb {
            url,
            _dir: None,
            drop_pg: Some((base, name)),
        })
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some((base, name)) = self.drop_pg.take() {
            // Best effort, on a thread of its own: Drop cannot await.
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    if let Ok(admin) = AnyPool::connect(&base).await {
                        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .execute(&admin)
                        .await;
                    }
                });
            })
            .join();
        }
    }
}
