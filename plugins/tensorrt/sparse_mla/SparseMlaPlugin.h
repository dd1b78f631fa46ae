// TensorRT IPluginV3 "DhsSparseMla": absorbed sparse MLA decode attention over resolved row locations.
#pragma once

#include "../common/plugin_base.h"

namespace dhisparse
{
namespace trt
{

//! Inputs: 0 q_lat [B, Q, H, rank] fp32|bf16, 1 q_pe [B, Q, H, rope] (q_lat's type), 2 kv arena: fp32 or bf16
//! [rows, rank + rope] (kv_format 0 / 1) or uint8 [rows, 656] (kv_format 2, DeepSeek-V3.2 FP8 row),
//! 3 locations [B, Q, K] int32 (-1 = masked). Output: 0 out_lat [B, Q, H, rank] in q_lat's type.
//! Fields: kv_lora_rank, qk_rope_head_dim, kv_format (int32), softmax_scale (float32 > 0).
class SparseMlaPlugin : public PluginBase<SparseMlaPlugin>
{
public:
    static constexpr char const* kName = "DhsSparseMla";
    static constexpr char const* kVersion = "1";
    static constexpr int32_t kNbInputs = 4;
    static constexpr int32_t kNbOutputs = 1;

    SparseMlaPlugin(int32_t rank, int32_t rope, int32_t kv_format, float softmax_scale);
    SparseMlaPlugin(SparseMlaPlugin const&) = default;

    static SparseMlaPlugin create(nvinfer1::PluginFieldCollection const* fc);
    static void describe_fields(FieldList& fields);
    void list_fields(FieldList& fields) const;

    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

private:
    nvinfer1::DataType kvType() const;

    int32_t mRank;
    int32_t mRope;
    int32_t mKvFormat;
    float mSoftmaxScale;
};

} // namespace trt
} // namespace dhisparse
