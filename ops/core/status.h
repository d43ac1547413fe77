// A minimal status type for the TF-free core (kernels translate it to
// tensorflow::Status).
#ifndef TF_SFCTR_OPS_CORE_STATUS_H_
#define TF_SFCTR_OPS_CORE_STATUS_H_

#include <string>
#include <utility>

namespace sfctr {

class CoreStatus {
 public:
  enum class Code { kOk, kInvalidArgument, kResourceExhausted };
  CoreStatus() = default;
  static CoreStatus Ok() { return CoreStatus(); }
  static CoreStatus InvalidArgument(std::string msg) {
    return CoreStatus(Code::kInvalidArgument, std::move(msg));
  }
  static CoreStatus ResourceExhausted(std::string msg) {
    return CoreStatus(Code::kResourceExhausted, std::move(msg));
  }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  CoreStatus(Code code, std::string msg) : code_(code), message_(std::move(msg)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_STATUS_H_
